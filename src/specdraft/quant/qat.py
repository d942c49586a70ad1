"""Quantisation-aware training: a model computes with the 4-bit weights its pack will store.

Fine-tuning deltas smaller than half a 4-bit step are rounded back to the init's values at pack time; training
through the packer's own rounding (``q4g.fake_quantize``, straight-through gradient) keeps them.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from specdraft.quant import q4g


class _STEFakeQuant(torch.autograd.Function):
    """Forward: the packed (4-bit) weight; backward: the gradient passes straight to the float weight."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return q4g.fake_quantize(weight, group_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def enable_qat(model, group_size: int) -> int:
    """Make the model compute with the weights `specdraft pack --group-size G` (default encodings) stores:
    every nn.Linear and the input embedding use ``q4g.fake_quantize`` of their weight. Trainable weights are
    re-quantised at every forward with a straight-through gradient; frozen ones (the tied embedding/head,
    ``freeze_layers``) once, into a non-persistent buffer, at the G the pack will store them at
    (``q4g.lossless_group_size``: a frozen layer on a finer grid stays exact). The parameters stay float (the
    optimizer's latent weights), so checkpoints, resume state and the packer see plain weights, and packing them
    reproduces exactly the model that was trained and evaluated. Returns the number of modules patched."""

    frozen: dict[int, torch.Tensor] = {}  # one quantised copy per frozen parameter (tied weights share it)

    def weight_of(module):
        if module.weight.requires_grad:
            return _STEFakeQuant.apply(module.weight, group_size)
        return module._qat_weight

    def linear_forward(self, x):
        return F.linear(x, weight_of(self), self.bias)

    def embedding_forward(self, ids):
        return F.embedding(ids, weight_of(self), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    embedding = model.get_input_embeddings()
    patched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            forward = linear_forward
        elif module is embedding:
            forward = embedding_forward
        else:
            continue
        if not module.weight.requires_grad:
            key = id(module.weight)
            if key not in frozen:
                with torch.no_grad():
                    w = module.weight.detach()  # the pack keeps a weight on its own finer grid as it is
                    frozen[key] = q4g.fake_quantize(w, q4g.lossless_group_size(w, group_size))
            module.register_buffer("_qat_weight", frozen[key], persistent=False)
        module.forward = types.MethodType(forward, module)
        patched += 1
    return patched
