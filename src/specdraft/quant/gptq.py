"""GPTQ: 4-bit rounding that compensates each weight's error on calibration inputs (Frantar et al., 2022).

``gptq_quantize`` rounds one weight on the QD04 grid given the Hessian of its layer's inputs;
``gptq_calibrate`` runs it over a decoder-only model one layer at a time, each layer seeing the outputs of the
layers below it as already quantised. The codes land on the same grid as plain rounding, so the file format,
the loaders and the int4 kernel do not change.
"""

from __future__ import annotations

import logging
import os

import torch
from tqdm import tqdm

from specdraft.core.records import read_traces
from specdraft.quant import q4g
from specdraft.quant.q4g import (
    DEFAULT_GROUP_SIZE,
    QMAX,
    QuantizedTensor,
    check_group_size,
    minmax_grid,
    num_groups,
    pack_codes,
)

log = logging.getLogger(__name__)

# GPTQ defaults (chosen on the trained draft, docs/history.md, "5. Pack"): damping as a fraction of the mean
# Hessian diagonal, columns by decreasing input energy with static groups
DEFAULT_GPTQ_DAMP = 0.1
DEFAULT_GPTQ_ACT_ORDER = True


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                  damp: float = DEFAULT_GPTQ_DAMP, act_order: bool = DEFAULT_GPTQ_ACT_ORDER) -> QuantizedTensor:
    """Calibrated q4g (GPTQ, Frantar et al. 2022): the same grid and file as ``quantize``, other codes.

    ``hessian`` [K, K] is the mean of x xᵀ over calibration inputs x of this layer. Columns are rounded one
    at a time; each column's rounding error is pushed onto the columns not yet rounded, weighted by the
    inverse Hessian, so the layer's output error on the calibration inputs is (approximately) least squares
    instead of each weight's. ``damp`` (a fraction of the mean diagonal) keeps the inverse stable.

    With ``act_order`` (the default) the columns go in decreasing order of their input energy (the Hessian
    diagonal) and every group's grid (minmax, fp16) is fitted first, on the original weights ("static
    groups": the file's groups stay contiguous). Left to right, a group's grid is fitted when its first
    column is reached, on the weights updated so far. With an identity Hessian no error moves and
    either way the result is exactly ``quantize(w, group_size)``.
    """
    check_group_size(group_size)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"q4g quantises 2-D floating-point tensors, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a weight of shape {tuple(w.shape)}, got "
                         f"{tuple(hessian.shape)}")
    if not (torch.isfinite(w).all() and torch.isfinite(hessian).all()):
        raise ValueError("gptq: weight or hessian holds NaN or infinite values")
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) <= 0  # inputs never seen: nothing to protect, round them plainly
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    order = (torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order
             else torch.arange(k))
    weight = w.detach().to(torch.float64)[:, order].clone()       # columns in processing order
    h = h[order][:, order]
    # upper Cholesky factor of H^-1: row i holds the weights that spread column i's error onto columns > i
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    ng = num_groups(k, group_size)
    codes = torch.empty(n, ng * group_size, dtype=torch.uint8)
    scales = torch.empty(n, ng, dtype=torch.float16)
    mins = torch.empty(n, ng, dtype=torch.float16)

    def fit_grid(g: int, block: torch.Tensor) -> None:  # block: float32, as quantize_groups sees its groups
        scales[:, g], mins[:, g] = minmax_grid(block.amin(dim=1), block.amax(dim=1), check_range=True)

    if act_order:
        original = w.detach().float()
        for g in range(ng):
            fit_grid(g, original[:, g * group_size:(g + 1) * group_size])
    # left to right, a block is one group so that its grid sees every earlier group's error
    block = 128 if act_order else group_size
    col_of = order.tolist()
    for b0 in range(0, k, block):
        b1 = min(k, b0 + block)
        if not act_order:
            fit_grid(b0 // group_size, weight[:, b0:b1].float())
        errors = torch.empty(n, b1 - b0, dtype=torch.float64)
        for i in range(b0, b1):
            j = col_of[i]
            s, m = scales[:, j // group_size].float(), mins[:, j // group_size].float()
            inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
            col = weight[:, i]
            q = ((col.float() - m) * inv).round_().clamp_(0, QMAX)  # codes as _codes computes them
            codes[:, j] = q.to(torch.uint8)
            err = (col - torch.addcmul(m, q, s).double()) / hinv[i, i]
            weight[:, i + 1:b1] -= err.unsqueeze(1) * hinv[i, i + 1:b1].unsqueeze(0)
            errors[:, i - b0] = err
        weight[:, b1:] -= errors @ hinv[b0:b1, b1:]   # the block's error, onto the columns after it
    if ng * group_size > k:  # padding repeats the last real code, as quantize_groups' padding does
        codes[:, k:] = codes[:, k - 1:k]
    return QuantizedTensor(pack_codes(codes), scales, mins, (n, k))


# ----------------------------------------------------------------------------------------- calibration

class _StopForward(Exception):
    pass


class _Hessian:
    """Running sum of x xᵀ over a linear layer's inputs (float64); ``mean()`` is what GPTQ weighs errors by."""

    def __init__(self, width: int):
        self.sum = torch.zeros(width, width, dtype=torch.float64)
        self.count = 0

    @staticmethod
    def outer(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = x.reshape(-1, x.shape[-1]).double()
        return x.T @ x, x.shape[0]

    def add(self, product: torch.Tensor, count: int) -> None:
        self.sum += product
        self.count += count

    def mean(self) -> torch.Tensor:
        return self.sum / max(1, self.count)


def calibration_sequences(path: str | os.PathLike, count: int, max_tokens: int) -> list[list[int]]:
    """``count`` traces (prompt + the target's completion) spread evenly over the file, each cut to its last
    ``max_tokens`` tokens: calibration text from the distribution the draft is trained and used on."""

    examples = read_traces(path, max_tokens)
    step = len(examples) / min(count, len(examples))
    return [examples[int(i * step)].input_ids for i in range(min(count, len(examples)))]


@torch.no_grad()
def gptq_calibrate(model, sequences: list[list[int]], group_size: int, damp: float = DEFAULT_GPTQ_DAMP,
                   act_order: bool = DEFAULT_GPTQ_ACT_ORDER, embedding_gptq: bool = True, progress: bool = True,
                   group_sizes: dict[str, int] | None = None) -> dict[str, q4g.QuantizedTensor]:
    """GPTQ every 2-D weight of a decoder-only model, one decoder layer at a time (``model.model.layers``).

    Each layer's Hessians come from the outputs of the layers before it *as already quantised*, so a layer
    corrects for the error of those below. The head (tied to the embedding, when it is) uses the final
    hidden states; an untied input embedding has no inputs to weigh and is rounded plainly. A weight that
    plain rounding reproduces exactly (at ``group_sizes[name]``, else ``group_size``) keeps those codes:
    there is no error to spread. The model's weights are replaced by their dequantised values along the
    way. Returns {stored name: codes}.
    """
    layers = _decoder_layers(model)
    rounder = _Rounder(model, group_size, group_sizes or {}, damp, act_order)
    cached = _first_layer_inputs(model, layers[0], sequences)
    for layer in tqdm(layers, desc="gptq", unit="layer", disable=not progress):
        linears = {n: m for n, m in layer.named_modules()
                   if isinstance(m, torch.nn.Linear) and not rounder.kept_exact(m)}
        if linears:  # a layer kept exact (all on its grid) needs no Hessians: one forward for the next layer
            rounder.round(linears, _layer_hessians(layer, linears, cached))
        cached = [_with_hidden(a, kw, layer(*a, **kw)) for a, kw in cached]

    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if isinstance(head, torch.nn.Linear) and (embedding_gptq or not tied) and not rounder.kept_exact(head):
        norm = getattr(model.model, "norm", None) or torch.nn.Identity()
        hessian = _Hessian(head.in_features)
        for a, kw in cached:  # the head's inputs directly: no need to compute the logits
            hessian.add(*_Hessian.outer(norm(_hidden(a, kw))))
        rounder.round({"head": head}, {"head": hessian})
    log.info("gptq: %d tensors rounded by GPTQ, %d kept exact on their grid", len(rounder.out) - len(rounder.exact),
             len(rounder.exact))
    return rounder.out


class _Rounder:
    """Where ``gptq_calibrate``'s codes go: a weight GPTQ-rounded (and replaced by its dequantised values), or
    kept as plain rounding gives it where that is exact. ``out`` maps stored names to codes."""

    def __init__(self, model, group_size: int, group_sizes: dict[str, int], damp: float, act_order: bool):
        self.names = {id(p): n for n, p in model.named_parameters()}  # tied parameters under their first name
        self.group_size, self.group_sizes, self.damp, self.act_order = group_size, group_sizes, damp, act_order
        self.out: dict[str, q4g.QuantizedTensor] = {}
        self.exact: list[str] = []

    def _group_size(self, name: str) -> int:
        return self.group_sizes.get(name, self.group_size)

    def kept_exact(self, m: torch.nn.Linear) -> bool:
        """Plain rounding reproduces the weight (it sits on its grid): no error to spread, keep those codes."""
        name = self.names[id(m.weight)]
        g = self._group_size(name)
        if not q4g.is_lossless(m.weight, g):
            return False
        self.out[name] = q4g.quantize(m.weight, g)
        self.exact.append(name)
        return True

    def round(self, linears: dict[str, torch.nn.Linear], hessians: dict[str, _Hessian]) -> None:
        for n, m in linears.items():
            name = self.names[id(m.weight)]
            q = gptq_quantize(m.weight, hessians[n].mean(), self._group_size(name), self.damp, self.act_order)
            m.weight.copy_(q4g.dequantize(q, m.weight.dtype))
            self.out[name] = q


def _decoder_layers(model) -> torch.nn.ModuleList:
    """``model.model.layers``, refused where GPTQ layer by layer cannot go."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(f"gptq: {type(model).__name__} has no model.layers (decoder-only models only)")
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:  # layer 0's attention inputs are reused for every layer
        raise ValueError(f"gptq: layers of different attention types ({sorted(set(layer_types))}) are not supported")
    return layers


def _first_layer_inputs(model, first: torch.nn.Module, sequences: list[list[int]]) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) the first decoder layer gets for each sequence: the forward stops there."""
    cached: list[tuple[tuple, dict]] = []

    def grab(module, args, kwargs):
        cached.append((args, kwargs))
        raise _StopForward

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for ids in sequences:
            try:
                model(input_ids=torch.tensor([ids]), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return cached


def _layer_hessians(layer: torch.nn.Module, linears: dict[str, torch.nn.Linear],
                    cached: list[tuple[tuple, dict]]) -> dict[str, _Hessian]:
    """Each of these linears' Hessian over the layer's calibration inputs (one forward per sequence)."""
    hessians = {n: _Hessian(m.in_features) for n, m in linears.items()}
    last: list = [None, None]  # q/k/v (and gate/up) read one input tensor: its x xᵀ is computed once

    def accumulate(name):
        def hook(module, inputs, output):
            if inputs[0] is not last[0]:
                last[:] = inputs[0], _Hessian.outer(inputs[0])
            hessians[name].add(*last[1])
        return hook

    handles = [m.register_forward_hook(accumulate(n)) for n, m in linears.items()]
    try:
        for a, kw in cached:
            layer(*a, **kw)
    finally:
        for h in handles:
            h.remove()
    return hessians


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, result) -> tuple[tuple, dict]:
    """A layer's inputs with its hidden states replaced by ``result``'s: the next layer's inputs."""
    h = result[0] if isinstance(result, tuple) else result
    return ((h, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": h})
