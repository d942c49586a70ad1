"""Does tuning a packed draft's per-group scales and minimums (its 4-bit codes fixed) win back what packing lost?

    .venv/bin/python bench/bench_scale_tuning.py --packed packF3L --traces tr3/traces.jsonl \
        --validation val80/validation.jsonl --steps 40 --out scale_tuning.json [--write packF3S]

An experiment, not a pipeline stage. The packed draft is rebuilt with every q4g linear of the layers that
trained (``--from-layer``) computing ``w = code * scale + min`` from its stored codes, with the fp16 scale and
min of each group as trainable parameters (PEQA, Kim et al. 2023: the codes stay, the step sizes move), plus
those layers' norms. The forward uses the fp16-rounded values (straight-through), so what it scores is exactly
what a QD04 file with the same codes and the tuned fp16 parameters holds. Loss: cross-entropy on the target's
completion tokens of ``--traces`` (the draft's own training traces), or with ``--teacher`` the KL divergence from
the float draft's next-token distribution on the same positions; 2,048-token batches, AdamW, cosine decay.
Simulated acceptance (one teacher-forced pass per validation prompt, pooled over points) at ``--eval-every``:
these points are the test set, so nothing is selected on them; the last step is the result. ``--write DIR``
copies the packed dir with the tuned parameters in its draft.qd4 (same codes, same layout) for `specdraft eval`.
The result goes to ``bench/results/scale_tuning.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench_gptq import validation_examples
from harness import add_out_argument, argument_parser, command, save_result, stopwatch
from specdraft.core.io import atomic_write_json, sha256_file
from specdraft.core.records import read_traces
from specdraft.drafting.simulated import simulated_acceptance
from specdraft.model.batching import collate, next_tokens, scored_positions
from specdraft.model.distill import make_batches
from specdraft.model.loader import load_packed_model
from specdraft.quant import q4g, qd4


def fp16_ste(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16 in the forward, identity in the backward: the file stores fp16 scales and mins."""
    return x + (x.half().float() - x).detach()


class ScaleTunedLinear(nn.Module):
    """y = x Wᵀ with W = code * scale + min per group of G; codes fixed, scales and mins trainable."""

    def __init__(self, q: q4g.QuantizedTensor):
        super().__init__()
        self.shape, self.group_size = q.shape, q.group_size
        self.register_buffer("codes", q4g.unpack_codes(q.codes).to(torch.float32))  # [N, Kp]
        self.scales = nn.Parameter(q.scales.float().clone())
        self.mins = nn.Parameter(q.mins.float().clone())

    def weight_value(self) -> torch.Tensor:
        n, k = self.shape
        ng = self.scales.shape[1]
        w = torch.addcmul(fp16_ste(self.mins).unsqueeze(-1), self.codes.view(n, ng, self.group_size),
                          fp16_ste(self.scales).unsqueeze(-1))
        return w.view(n, -1)[:, :k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_value())

    def stored(self) -> q4g.QuantizedTensor:
        with torch.no_grad():
            return q4g.QuantizedTensor(q4g.pack_codes(self.codes.to(torch.uint8)), self.scales.half(),
                                       self.mins.half(), self.shape)


class CodeTunedLinear(nn.Module):
    """y = x Wᵀ with W = clamp(round((V - min) / scale), 0, 15) * scale + min per group: the fp16 scales and mins
    fixed, a float latent V per weight trainable (straight-through rounding). V starts at the stored weight, so
    step 0 is the packed draft exactly; a code changes once V has moved half a step."""

    def __init__(self, q: q4g.QuantizedTensor):
        super().__init__()
        n, k = q.shape
        self.shape, self.group_size = q.shape, q.group_size
        if k % q.group_size:
            raise ValueError(f"{q.shape}: in_features not a multiple of G = {q.group_size}")
        self.register_buffer("scales", q.scales.float().unsqueeze(-1))  # [N, K/G, 1]
        self.register_buffer("mins", q.mins.float().unsqueeze(-1))
        self.register_buffer("flat", (q.scales == 0).unsqueeze(-1))  # constant groups: their code stays 0
        self.latent = nn.Parameter(q4g.dequantize(q, torch.float32).clone())

    def codes(self) -> torch.Tensor:
        n, k = self.shape
        v = self.latent.view(n, -1, self.group_size)
        q = ((v - self.mins) / torch.where(self.flat, 1.0, self.scales)).round().clamp(0, 15)
        return q.masked_fill(self.flat, 0)  # [N, K/G, G]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w = (self.codes() * self.scales + self.mins).view(self.shape)
        return F.linear(x, self.latent + (w - self.latent).detach())

    def stored(self) -> q4g.QuantizedTensor:
        with torch.no_grad():
            codes = self.codes().view(self.shape).to(torch.uint8)
            return q4g.QuantizedTensor(q4g.pack_codes(codes), self.scales.squeeze(-1).half(),
                                       self.mins.squeeze(-1).half(), self.shape)


def swap_layers(model, stored: dict, first_layer: int, tune: str = "scales"
                ) -> tuple[dict[str, nn.Module], list[nn.Parameter]]:
    """Replace the q4g linears of layers >= first_layer by ScaleTunedLinear (or CodeTunedLinear with
    ``tune="codes"``); return them and the trainable params (theirs and the layers' norms)."""
    for p in model.parameters():
        p.requires_grad_(False)
    tuned: dict[str, nn.Module] = {}
    params: list[nn.Parameter] = []
    for i, layer in enumerate(model.model.layers):
        if i < first_layer:
            continue
        for name, module in list(layer.named_modules()):
            full = f"model.layers.{i}.{name}"
            if isinstance(module, nn.Linear) and module.bias is None and isinstance(stored.get(f"{full}.weight"),
                                                                                    q4g.QuantizedTensor):
                new = (CodeTunedLinear if tune == "codes" else ScaleTunedLinear)(stored[f"{full}.weight"])
                parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
                setattr(parent, name.rsplit(".", 1)[-1], new)
                tuned[f"{full}.weight"] = new
                params += [new.latent] if tune == "codes" else [new.scales, new.mins]
            elif "norm" in name.rsplit(".", 1)[-1] and hasattr(module, "weight"):
                module.weight.requires_grad_(True)
                params.append(module.weight)
    return tuned, params


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--packed", required=True, help="packed draft dir (specdraft pack)")
    ap.add_argument("--traces", required=True, help="traces JSONL to tune on (the draft's training traces)")
    ap.add_argument("--validation", required=True, help="validation.jsonl to score on (never selected on)")
    ap.add_argument("--from-layer", type=int, default=12, help="first decoder layer whose scales/mins are tuned")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teacher", default=None, help="float checkpoint of the same draft: tune toward its next-token "
                    "distribution (KL) instead of the target's tokens (cross-entropy)")
    ap.add_argument("--tune", choices=("scales", "codes"), default="scales",
                    help="scales: each group's fp16 scale and min (codes fixed); codes: a latent per weight whose "
                         "rounding on the fixed grid gives the codes (scales and mins fixed)")
    ap.add_argument("--write", default=None, help="write the tuned packed dir here")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    packed = Path(args.packed)
    model, _ = load_packed_model(packed, torch.float32)
    stored = qd4.load_qd4_quantized(packed / "draft.qd4")
    tuned, params = swap_layers(model, stored, args.from_layer, args.tune)
    print(f"tuning {sum(p.numel() for p in params):,} parameters ({len(tuned)} linears' {args.tune}, norms)",
          flush=True)
    teacher = None
    if args.teacher:
        from specdraft.model.specs import load_model
        teacher = load_model(args.teacher, dtype=torch.float32).eval()
    examples = read_traces(args.traces, args.max_seq_len)
    validation = validation_examples(args.validation)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    history = []

    def evaluate(step: int, loss: float | None) -> None:
        model.eval()
        with torch.no_grad():
            # what the file will hold: fp16 norms too. The latents are rounded in place (the last step always
            # evaluates, so --write stores exactly what was scored last); a code latent is not stored, its code is
            latents = {id(m.latent) for m in tuned.values() if isinstance(m, CodeTunedLinear)}
            for p in params:
                if id(p) not in latents:
                    p.copy_(p.half().float())
            stats = simulated_acceptance(model, validation, k=16)
        model.train()
        history.append({"step": step, "train_loss": loss, "pooled": stats.mean_accepted_pooled,
                        "per_prompt": stats.mean_accepted_per_prompt})
        print(f"step {step}: train loss {loss}, simulated acceptance pooled {stats.mean_accepted_pooled:.3f}",
              flush=True)

    evaluate(0, None)
    batches = [b for epoch in range(100) for b in make_batches(examples, args.batch_tokens, args.seed, epoch)]
    losses: list[float] = []
    with stopwatch() as tuning:
        model.train()
        for step in range(1, args.steps + 1):
            lr = args.lr * (step / args.warmup if step <= args.warmup else
                            0.5 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, args.steps - args.warmup))))
            for group in opt.param_groups:
                group["lr"] = lr
            batch = collate([examples[i] for i in batches[step - 1]], 0, "cpu")
            scored = scored_positions(batch["labels"])  # the head runs at the completion positions alone
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           logits_to_keep=scored).logits  # [N, V]
            if teacher is None:
                loss = F.cross_entropy(logits.float(), next_tokens(batch["labels"], batch["labels"]))
            else:  # KL(float draft || packed draft) on the completion positions
                with torch.no_grad():
                    target = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     logits_to_keep=scored).logits  # [N, V]
                loss = F.kl_div(logits.float().log_softmax(-1), target.float().log_softmax(-1),
                                log_target=True, reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if step % args.eval_every == 0 or step == args.steps:
                evaluate(step, sum(losses[-args.eval_every:]) / len(losses[-args.eval_every:]))

    written = None
    if args.write:
        out = Path(args.write)
        shutil.copytree(packed, out)
        header = qd4.read_qd4_header(packed / "draft.qd4")
        state = {n: p.detach().clone() for n, p in qd4.stored_tensors(model).items()}
        tensors, encodings, quantized, group_sizes = {}, {}, {}, {}
        for e in header.entries:
            encodings[e.name] = e.encoding
            if e.encoding == "q4g":
                quantized[e.name] = tuned[e.name].stored() if e.name in tuned else stored[e.name]
                tensors[e.name] = q4g.dequantize(quantized[e.name])
                group_sizes[e.name] = e.group_size
            else:
                tensors[e.name] = state[e.name]
        qd4.write_qd4(out / "draft.qd4", tensors, encodings, header.group_size, header.producer.get("fit", "minmax"),
                      quantized=quantized, group_sizes=group_sizes)
        sha, nbytes = sha256_file(out / "draft.qd4"), (out / "draft.qd4").stat().st_size
        for name in ("architecture.json",):
            arch = json.loads((out / name).read_text())
            arch.update(bytes=nbytes, sha256=sha)
            atomic_write_json(out / name, arch)
        recipe = json.loads((out / "pack_recipe.json").read_text())
        recipe["output"].update(bytes=nbytes, sha256=sha, payload_sha256=qd4.read_qd4_header(out / "draft.qd4")
                                .payload_sha256)
        recipe["scale_tuning"] = {"command": command(), "from": str(packed),
                                  "traces_sha256": sha256_file(args.traces), "steps": args.steps, "lr": args.lr}
        atomic_write_json(out / "pack_recipe.json", recipe)
        written = {"dir": str(out), "bytes": nbytes, "sha256": sha}
        print(f"wrote {out}", flush=True)

    save_result("scale_tuning", {
        "packed": str(packed),
        "packed_sha256": sha256_file(packed / "draft.qd4"), "traces_sha256": sha256_file(args.traces),
        "validation_sha256": sha256_file(args.validation), "tuned_linears": len(tuned),
        "tuned_parameters": sum(p.numel() for p in params), "args": vars(args), "seconds": round(tuning.wall, 1),
        "history": history, "written": written}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
