"""Benchmark the pack stage: bytes, teacher-forced greedy agreement and load time, packed vs float.

    .venv/bin/python bench/bench_pack.py --out runs/bench_pack/pack.json

On the embedded default target (a stand-in for the trained draft, which does not exist yet) it packs
several variants (group size, embedding encoding), then for each:
  * bytes of draft.qd4 against the fp16 safetensors of the same model (goal <= 0.30x);
  * greedy agreement over >= 2,000 positions of real text: one teacher-forced forward pass per window of
    chat-formatted prompts + answers from /work/shared/data/train, argmax of the packed model against
    argmax of the float model at every position (goal >= 97%);
  * load time: load_packed_model (checksum included) against from_pretrained of fp16 and fp32 safetensors.
The mean accepted length of packed vs float draft needs a trained draft and a validation file: pass
--validation, --float-checkpoint and --packed-dir (otherwise it is reported as pending). The result goes to
``bench/results/pack.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from harness import add_out_argument, argument_parser, command, median, save_result, stopwatch, timed
from specdraft.core.io import sha256_file
from specdraft.model.loader import load_packed_model
from specdraft.model.specs import DEFAULT_TARGET, resolve_model
from specdraft.quant import qd4
from specdraft.stages.pack import PackConfig, run_pack

DATA_DIR = Path("/work/shared/data/train")
TEXT_FILES = ("code_alpaca_2k.json", "llamafactory_alpaca_en_demo.json", "gpteacher_roleplay_instruct.json")
VARIANTS: dict[str, dict[str, Any]] = {
    "q4g-G64": {"group_size": 64},                 # the default: tensors already on a finer (G=32) grid keep it
    "q4g-G64-flat": {"group_size": 64, "lossless_grids": False},     # every tensor at G=64 (before format v2)
    "q4g-G64-lsq": {"group_size": 64, "fit": "lsq"},
    "q4g-G32": {"group_size": 32},
    "q4g-G128": {"group_size": 128},
    "q4g-G64+emb-f16": {"group_size": 64, "embedding_encoding": "f16"},
    "q4g-G32+emb-f16": {"group_size": 32, "embedding_encoding": "f16"},
    "q4g-G64-gptq": {"group_size": 64, "fit": "gptq"},                # these need --calibration
    "q4g-G64-gptq+emb-f16": {"group_size": 64, "fit": "gptq", "embedding_encoding": "f16"},
    "q4g-G64-gptq-flat": {"group_size": 64, "fit": "gptq", "lossless_grids": False},
}


# ------------------------------------------------------------------------------------------ real text

def conversations(files: Sequence[str] = TEXT_FILES, data_dir: Path = DATA_DIR) -> Iterator[list[dict]]:
    """Alpaca-style records as chat turns, round-robin over the files (a fixed, reproducible order)."""
    records = []
    for name in files:
        rows = json.loads((data_dir / name).read_text(encoding="utf-8"))
        records.append([r for r in rows if (r.get("output") or r.get("response"))])
    for i in range(max(len(r) for r in records)):
        for rows in records:
            if i < len(rows):
                r = rows[i]
                user = r["instruction"] + (("\n\n" + r["input"]) if r.get("input") else "")
                yield [{"role": "user", "content": user},
                       {"role": "assistant", "content": r.get("output") or r.get("response")}]


def text_windows(tokenizer, positions: int, seq_len: int) -> list[list[int]]:
    """Windows of ``seq_len`` tokens cut from one stream of chat-formatted conversations."""
    stream: list[int] = []
    needed = -(-positions // seq_len) * seq_len
    for conv in conversations():
        stream += tokenizer.apply_chat_template(conv, tokenize=True, return_dict=False)
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise RuntimeError(f"only {len(stream)} tokens of text, need {needed}")
    return [stream[i:i + seq_len] for i in range(0, needed, seq_len)]


# -------------------------------------------------------------------------------------------- measures

@torch.inference_mode()
def logits_of(model, windows: list[list[int]], batch: int = 4) -> torch.Tensor:
    """[W, T, V] float32 logits, one teacher-forced forward pass per batch of windows."""
    out = []
    for i in range(0, len(windows), batch):
        ids = torch.tensor(windows[i:i + batch])
        out.append(model(input_ids=ids).logits.float())
    return torch.cat(out)


def agreement_counts(ref: torch.Tensor, other: torch.Tensor, confident: float = 0.5) -> dict[str, int | float]:
    """Counts: argmax equal (everywhere, and where the float model's top-1 probability >= ``confident``),
    float argmax within the packed top-5; plus logit error measures."""
    a, b = ref.argmax(-1), other.argmax(-1)
    top5 = other.topk(5, dim=-1).indices
    sure = ref.softmax(-1).amax(-1) >= confident
    return {"positions": a.numel(), "argmax_equal": int((a == b).sum()),
            "confident_positions": int(sure.sum()), "confident_argmax_equal": int(((a == b) & sure).sum()),
            "ref_in_top5": int((top5 == a.unsqueeze(-1)).any(-1).sum()),
            "mean_abs_logit_diff": float((ref - other).abs().mean()),
            "rel_logit_error": float((ref - other).norm() / ref.norm())}


def weight_errors(src_state: dict[str, torch.Tensor], qd4_path: Path, emb_name: str) -> dict[str, float]:
    """Relative Frobenius error of the dequantised weights: the embedding and all other matrices."""
    deq = qd4.load_qd4(qd4_path, torch.float32, verify=False)
    num = {"embedding": 0.0, "matrices": 0.0}
    den = {"embedding": 0.0, "matrices": 0.0}
    for name, w in deq.items():
        if w.dim() != 2:
            continue
        key = "embedding" if name == emb_name else "matrices"
        ref = src_state[name].float()
        num[key] += float((w - ref).pow(2).sum())
        den[key] += float(ref.pow(2).sum())
    return {k: (num[k] / den[k]) ** 0.5 if den[k] else 0.0 for k in num}


def acceptance_packed_vs_float(validation: str | None, float_checkpoint: str | None, packed_dir: str | None,
                               k: int = 16, limit: int | None = None) -> dict[str, Any]:
    """Mean accepted length of the packed draft vs the float draft on a validation file (k-token drafts)."""
    if not (validation and float_checkpoint and packed_dir):
        return {"status": "pending", "reason": "needs the trained draft: pass --validation, --float-checkpoint "
                                               "and --packed-dir"}
    from specdraft.drafting.batched import ModelDrafter
    from specdraft.drafting.metrics import AcceptanceStats
    from specdraft.model.specs import load_model

    points = [json.loads(line) for line in Path(validation).read_text(encoding="utf-8").splitlines() if line.strip()]
    points = points[:limit] if limit else points
    contexts = [p["context_ids"] for p in points]
    packed, _ = load_packed_model(packed_dir)
    result: dict[str, Any] = {"status": "measured", "validation": validation,
                              "validation_sha256": sha256_file(validation), "points": len(points), "k": k}
    drafts = {}
    for name, model in (("float", load_model(float_checkpoint)), ("packed", packed)):
        stats = AcceptanceStats(k=k)
        drafts[name] = ModelDrafter(model, name).draft(contexts, k)
        for p, d in zip(points, drafts[name]):
            stats.add(d, p["target_ids"], prompt_id=str(p["id"]), category=p.get("category", ""))
        result[name] = stats.summary()
    result["identical_drafts"] = sum(a == b for a, b in zip(drafts["float"], drafts["packed"]))
    return result


# ----------------------------------------------------------------------------------------------- main

def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(args.model)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_pack."))
    tokenizer = AutoTokenizer.from_pretrained(src)
    float_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    src_state = {k: v.clone() for k, v in qd4.stored_tensors(float_model).items()}
    emb_name = qd4.embedding_name(float_model)

    fp16_dir = work / "fp16"
    if not (fp16_dir / "model.safetensors").is_file():
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16).save_pretrained(fp16_dir)
    fp16_bytes = sum(f.stat().st_size for f in fp16_dir.glob("*.safetensors"))

    windows = text_windows(tokenizer, args.positions, args.seq_len)
    with stopwatch() as float_forward:
        ref = logits_of(float_model, windows)
    # median of --repeats loads after one untimed load (the page cache warm for every loader)
    float_load_fp32 = median(timed(lambda: AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32),
                                   args.repeats))
    float_load_fp16 = median(timed(lambda: AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float16),
                                   args.repeats))

    rows = []
    for name in args.variants:
        overrides = VARIANTS[name]
        out = work / name
        calibration = {"calibration": args.calibration} if overrides.get("fit") == "gptq" else {}
        result = run_pack(PackConfig(checkpoint=str(src), out=str(out), overwrite=True, **overrides, **calibration))
        load_s = median(timed(lambda: load_packed_model(out), args.repeats))
        model, info = load_packed_model(out)  # its checksum read with the page cache as warm as the timed loads
        counts = agreement_counts(ref, logits_of(model, windows))
        rows.append({
            "variant": name, **overrides, **calibration,
            "bytes": result.bytes, "ratio_vs_fp16": result.bytes / fp16_bytes,
            "estimate_bytes": qd4.estimate_packed_bytes(src, overrides["group_size"],
                                                        embedding_encoding=overrides.get("embedding_encoding", "q4g"),
                                                        fit=overrides.get("fit", "minmax")),
            **counts, "agreement": counts["argmax_equal"] / counts["positions"],
            "agreement_confident": counts["confident_argmax_equal"] / max(counts["confident_positions"], 1),
            "top5": counts["ref_in_top5"] / counts["positions"],
            "weight_rel_error": weight_errors(src_state, out / "draft.qd4", emb_name),
            "load_seconds": load_s, "read_sha256_seconds": info.read_seconds, "pack_seconds": result.seconds,
        })
        del model
    return {
        "model": args.model, "model_path": str(src),
        "source_weights_sha256": sha256_file(next(src.glob("*.safetensors"))),
        "text": {"files": list(TEXT_FILES), "windows": len(windows), "seq_len": args.seq_len,
                 "positions": sum(map(len, windows)),
                 "sha256": {f: sha256_file(DATA_DIR / f) for f in TEXT_FILES}},
        "threads": torch.get_num_threads(),
        "fp16_safetensors_bytes": fp16_bytes,
        "float_forward_seconds": float_forward.wall,
        "from_pretrained_seconds": {"fp32": float_load_fp32, "fp16": float_load_fp16},
        "variants": rows,
        "acceptance": acceptance_packed_vs_float(args.validation, args.float_checkpoint, args.packed_dir),
        "goals": {"ratio_vs_fp16": 0.30, "agreement": 0.97},
    }


def table(report: dict[str, Any]) -> str:
    lines = ["| variant | bytes | × fp16 | agreement | agreement (p≥0.5) | top-5 | rel. logit err | "
             "W err emb / other | load s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["variants"]:
        we = r["weight_rel_error"]
        lines.append(f"| {r['variant']} | {r['bytes']:,} | {r['ratio_vs_fp16']:.3f} | {r['agreement']:.2%} | "
                     f"{r['agreement_confident']:.2%} | {r['top5']:.2%} | {r['rel_logit_error']:.3f} | "
                     f"{we['embedding']:.3f} / {we['matrices']:.3f} | {r['load_seconds']:.2f} |")
    fp = report["from_pretrained_seconds"]
    lines.append(f"\nfp16 safetensors: {report['fp16_safetensors_bytes']:,} bytes; from_pretrained "
                 f"fp16 {fp['fp16']:.2f}s, fp32 {fp['fp32']:.2f}s; positions: {report['text']['positions']:,} "
                 f"({report['variants'][0]['confident_positions']:,} with float p(top-1) >= 0.5); threads: "
                 f"{report['threads']}; "
                 f"acceptance (packed vs float draft): {report['acceptance']['status']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_out_argument(parser)
    parser.add_argument("--model", default=DEFAULT_TARGET, help="model spec to pack (stand-in for the draft)")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="default: all (the gptq ones only with --calibration)")
    parser.add_argument("--calibration", default=None,
                        help="traces JSONL of the model (specdraft traces) to calibrate the gptq variants")
    parser.add_argument("--positions", type=int, default=2048, help="teacher-forced positions (at least)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per forward window")
    parser.add_argument("--repeats", type=int, default=3, help="timed loads per loader (median reported)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 by default: on a shared machine, OpenMP oversubscription makes "
                             "load times of many small ops meaningless)")
    parser.add_argument("--work-dir", default=None, help="where packed dirs go (default: a temp dir)")
    parser.add_argument("--validation", default=None, help="validation.jsonl for the acceptance comparison")
    parser.add_argument("--float-checkpoint", default=None, help="the float (trained) draft checkpoint")
    parser.add_argument("--packed-dir", default=None, help="the packed draft dir made from it")
    args = parser.parse_args(argv)
    needs_calibration = [v for v in VARIANTS if VARIANTS[v].get("fit") == "gptq"]
    if args.variants is None:
        args.variants = [v for v in VARIANTS if args.calibration or v not in needs_calibration]
    elif args.calibration is None and set(args.variants) & set(needs_calibration):
        parser.error(f"--calibration TRACES.jsonl is needed for {sorted(set(args.variants) & set(needs_calibration))}")
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print("$", command())
    report = run(args)
    save_result("pack", report, args.out)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
