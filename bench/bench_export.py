"""Benchmark the exports against readers that are not specdraft's: transformers (GGUF and HF) and llama.cpp.

    .venv/bin/python bench/bench_export.py --out bench/out/export.json [--model-dir PACKED_DIR]
        [--validation VALIDATION.jsonl] [--points 512] [--work-dir DIR]

1. The packed draft: --model-dir, else the embedded target packed with the defaults (`specdraft pack`), the
   self-draft. Evaluation points: --validation, else `specdraft validation` of the MT-bench prompts.
2. GGUF (`specdraft export --format gguf`): transformers' ``from_pretrained(gguf_file=)`` reads the file back;
   its weights against ``load_draft(dir, "float32")``'s, bit for bit, and its greedy drafts (16 tokens, its own
   forward and cache) against the packed draft's (``draft_batch``) on every point. A draft that differs is shown
   with the packed draft's top-2 logit gap where they part (a near-tie, or not).
3. llama.cpp, when llama-cpp-python is installed (``specdraft[llama]``): the same drafts from llama.cpp running
   the file (``drafting.llamacpp.LlamaCppDrafter``; its Q4_1 kernels quantise activations to 8 bits, so
   agreement, not identity, is expected); llama.cpp's draft/target vocabulary check
   (``common_speculative_are_compatible``) against the embedded target's GGUF; and speculative decoding in
   llama.cpp with the target GGUF and this draft (``LlamaCppTarget``), against the target's plain greedy, with
   llama-cpp-python's own prompt-lookup drafter in the same loop as a control (a difference both show comes from
   the target's multi-token verification passes; the first one of ours is shown with the target's top-2 logits
   in a one-token and a multi-token pass). Speed in llama.cpp is `specdraft speculate --engine llama.cpp`.
4. HF (`specdraft export --format hf`, bf16): transformers' ``target.generate(assistant_model=draft)`` against
   the target's plain greedy on the points at offset 0 (the prompts); acceptance per step from transformers'
   own candidate generator.

The result goes to ``bench/results/export.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from harness import add_out_argument, argument_parser, command, save_result, stopwatch
from specdraft.core.records import load_validation
from specdraft.drafting.llamacpp import LlamaCppDrafter, LlamaCppNgramDrafter
from specdraft.drafting.speculative import speculative_generate
from specdraft.model.decode import draft_batch
from specdraft.model.llamacpp import (
    INSTALL_HINT,
    LlamaCppTarget,
    llama_cpp_available,
    llama_cpp_version,
    vocab_compatible,
)
from specdraft.model.loader import load_draft
from specdraft.model.simple_decode import transformers_greedy
from specdraft.model.specs import DEFAULT_TARGET, embedded_gguf_path, resolve_model
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.traces import ValidationConfig, run_validation

MT_BENCH = Path("/work/shared/data/dev/mt_bench.jsonl")
K = 16


@torch.inference_mode()
def top2_gap(model, ids: list[int]) -> tuple[float, list[int]]:
    """The float32 logit gap between the top two tokens after ``ids`` (a near-tie when tiny), and those two."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    prefix = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]
    n = len(a)
    return {"points": n, "identical": sum(p == K for p in prefix), "identical_fraction": round(
        sum(p == K for p in prefix) / n, 4), "first_token_agree": round(sum(p > 0 for p in prefix) / n, 4),
        "mean_common_prefix": round(statistics.fmean(prefix), 3)}


def differences(model, contexts, ours, theirs, limit: int = 20) -> list[dict[str, Any]]:
    out = []
    for i, (c, u, v) in enumerate(zip(contexts, ours, theirs)):
        if u == v:
            continue
        j = next(j for j, (x, y) in enumerate(zip(u, v)) if x != y)
        gap, top = top2_gap(model, list(c) + u[:j])
        out.append({"point": i, "position": j, "packed": u[j], "other": v[j], "packed_top2": top,
                    "packed_top2_logit_gap": gap})
        if len(out) >= limit:
            break
    return out


# ------------------------------------------------------------------------------------------------ GGUF

def bench_gguf(model_dir: Path, work: Path, contexts: list[list[int]], packed, ours) -> dict[str, Any]:
    with stopwatch() as export:
        res = run_export(ExportConfig(model_dir=str(model_dir), format="gguf", out=str(work / "draft.gguf"),
                                      overwrite=True))
    record = json.loads(res.record.read_text())
    out: dict[str, Any] = {"export_seconds": round(export.wall, 2), "bytes": record["output"]["bytes"],
                           "qd4_bytes": record["source"]["weight_files"][0]["bytes"],
                           "tensor_types": record["tensor_types"], "all_exact": record["exact"],
                           "not_exact": record["not_exact"], "tokenizer": record["tokenizer"]}
    theirs = AutoModelForCausalLM.from_pretrained(work, gguf_file="draft.gguf", dtype=torch.float32).eval()
    a, b = theirs.state_dict(), packed.state_dict()
    out["transformers_weights_bit_equal"] = f"{sum(torch.equal(a[k], b[k]) for k in b if k in a)} of {len(b)}"
    with stopwatch() as drafting:
        drafts = [transformers_greedy(theirs, c, K) for c in contexts]
    out["transformers_draft_seconds"] = round(drafting.wall, 1)
    out["transformers_vs_packed"] = agreement(ours, drafts)
    out["transformers_differences"] = differences(packed, contexts, ours, drafts)
    return out


# ------------------------------------------------------------------------------------------- llama.cpp

def bench_llama_cpp(work: Path, contexts, ours, prompts, threads: int, spec_tokens: int, k: int) -> dict[str, Any]:
    if not llama_cpp_available():
        return {"skipped": f"llama-cpp-python is not installed ({INSTALL_HINT})"}
    out: dict[str, Any] = {"llama_cpp_python": llama_cpp_version()}
    n_ctx = max(map(len, contexts)) + K + spec_tokens + 64
    drafter = LlamaCppDrafter(work / "draft.gguf", n_ctx, threads)
    with stopwatch() as drafting:
        drafts = [drafter.draft_one(list(c), K) for c in contexts]
    out["draft_seconds"] = round(drafting.wall, 1)
    out["llama_cpp_vs_packed"] = agreement(ours, drafts)
    target_gguf = embedded_gguf_path(DEFAULT_TARGET.removeprefix("embedded:"))
    out["vocab_check_against_target_gguf"] = {"target": target_gguf.name, **vocab_compatible(target_gguf,
                                                                                              work / "draft.gguf")}
    # speculative decoding in llama.cpp: the target GGUF verifies what llama.cpp drafts with draft.gguf
    target = LlamaCppTarget(target_gguf, n_ctx=n_ctx, threads=threads)
    same, accepted, plain_s, spec_s, mismatches = 0, [], 0.0, 0.0, []
    for p, ids in enumerate(prompts):
        with stopwatch() as plain_lap:
            plain = target.greedy(ids, spec_tokens).tokens
        with stopwatch() as spec_lap:
            gen = speculative_generate(target, drafter, ids, spec_tokens, k)
        plain_s += plain_lap.wall
        spec_s += spec_lap.wall
        same += gen.tokens == plain
        accepted += gen.accepted_per_step
        if gen.tokens != plain:
            j = next(j for j, (u, v) in enumerate(zip(plain, gen.tokens)) if u != v)
            mismatches.append({"prompt": p, "position": j, "plain": plain[j], "speculative": gen.tokens[j],
                               **_near_tie(target.model, list(ids), plain[:j], k + 1)})
    # control: llama-cpp-python's own drafter (prompt lookup) in the same loop; where it too changes the output,
    # the change comes from the target's verification passes, not from what was drafted
    control = sum(speculative_generate(target, LlamaCppNgramDrafter(), ids, spec_tokens, k).tokens
                  == target.greedy(ids, spec_tokens).tokens for ids in prompts)
    out["speculative"] = {"target": target_gguf.name, "prompts": len(prompts), "new_tokens": spec_tokens,
                          "control_prompt_lookup_equal_to_plain_greedy": f"{control} of {len(prompts)}",
                          "k": k, "outputs_equal_to_plain_greedy": f"{same} of {len(prompts)}",
                          "mismatches": mismatches,
                          "mean_accepted_per_draft": round(statistics.fmean(accepted), 3) if accepted else None,
                          "plain_seconds": round(plain_s, 2), "speculative_seconds": round(spec_s, 2)}
    drafter.close()
    target.close()
    return out


def _near_tie(model, ids: list[int], tokens: list[int], batch: int) -> dict[str, Any]:
    """The target's next-token logits after ids + tokens as plain greedy computes them (the generated tokens one
    at a time) and as a verification pass does (the last ``batch`` positions in one pass): top two and gap."""
    out = {}
    seq = ids + tokens
    for label, tail in (("one_token_pass", 1), ("multi_token_pass", batch)):
        tail = min(tail, len(tokens)) or 1
        model.decode(ids, 0)
        for pos in range(len(ids), len(seq) - tail):
            model.decode(seq[pos:pos + 1], pos)
        logits = model.decode(seq[len(seq) - tail:], len(seq) - tail)[-1]
        top = np.argsort(logits)[::-1][:2]
        out[label] = {"top2": [int(t) for t in top], "logit_gap": float(logits[top[0]] - logits[top[1]])}
    return out


# -------------------------------------------------------------------------------------------------- HF

def bench_hf(model_dir: Path, work: Path, prompts, new_tokens: int) -> dict[str, Any]:
    res = run_export(ExportConfig(model_dir=str(model_dir), format="hf", out=str(work / "hf"), overwrite=True))
    record = json.loads(res.record.read_text())
    target = AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_TARGET), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(work / "hf").eval()
    matches: list[int] = []
    real = AssistedCandidateGenerator.update_candidate_strategy

    def record_matches(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return real(self, input_ids, scores, num_matches)
    AssistedCandidateGenerator.update_candidate_strategy = record_matches
    pad = target.generation_config.pad_token_id
    same, plain_s, assisted_s, mismatches = 0, 0.0, 0.0, []
    try:
        for p, ids in enumerate(prompts):
            x = torch.tensor([ids])
            with stopwatch() as plain_lap:
                plain = target.generate(x, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad)[0].tolist()
            with stopwatch() as assisted_lap:
                assisted = target.generate(x, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad,
                                           assistant_model=draft)[0].tolist()
            plain_s += plain_lap.wall
            assisted_s += assisted_lap.wall
            if assisted == plain:
                same += 1
                continue
            j = next((j for j, (u, v) in enumerate(zip(plain, assisted)) if u != v), min(len(plain), len(assisted)))
            gap, top = top2_gap(target, plain[:j]) if j < min(len(plain), len(assisted)) else (None, None)
            mismatches.append({"prompt": p, "position": j - len(ids), "plain": plain[j:j + 1],
                               "assisted": assisted[j:j + 1], "target_top2": top, "target_top2_logit_gap": gap})
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = real
    return {"dtype": record["dtype"], "bytes": sum(f["bytes"] for f in record["output"]["files"]),
            "generation_config": record["generation_config"], "prompts": len(prompts), "new_tokens": new_tokens,
            "outputs_equal_to_plain_greedy": f"{same} of {len(prompts)}", "mismatches": mismatches,
            "steps": len(matches), "mean_accepted_per_step": round(statistics.fmean(matches), 3) if matches else None,
            "plain_seconds": round(plain_s, 2), "assisted_seconds": round(assisted_s, 2)}


# ------------------------------------------------------------------------------------------------ main

def run(args) -> dict[str, Any]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_export."))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        model_dir = work / "model_self"
        if not (model_dir / "draft.qd4").is_file():
            run_pack(PackConfig(checkpoint=DEFAULT_TARGET, out=str(model_dir), overwrite=True))
    validation = Path(args.validation) if args.validation else work / "validation" / "validation.jsonl"
    if not args.validation:  # resumes a partial file
        run_validation(ValidationConfig(prompts=MT_BENCH, out=validation, target=DEFAULT_TARGET,
                                        max_new_tokens=args.validation_tokens, num_draft=K, device="cpu"))
    points = load_validation(validation, k=K)[:args.points]
    contexts = [p.context_ids for p in points]
    prompts = [p.context_ids for p in points if p.offset == 0][:args.prompts]
    packed, _ = load_draft(model_dir, "float32")
    with stopwatch() as drafting:
        ours = [d for i in range(0, len(contexts), 32) for d in draft_batch(packed, contexts[i:i + 32], K)]
    report: dict[str, Any] = {"model_dir": str(model_dir), "validation": str(validation), "points": len(points),
                              "packed_draft_seconds": round(drafting.wall, 1)}
    report["gguf"] = bench_gguf(model_dir, work, contexts, packed, ours)
    print(json.dumps(report["gguf"], indent=1)[:3000], flush=True)
    if not args.skip_llama_cpp:
        report["llama_cpp"] = bench_llama_cpp(work, contexts, ours, prompts, args.threads, args.new_tokens, args.k)
        print(json.dumps(report["llama_cpp"], indent=1), flush=True)
    report["hf"] = bench_hf(model_dir, work, prompts, args.new_tokens)
    print(json.dumps(report["hf"], indent=1), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_out_argument(parser)
    parser.add_argument("--model-dir", default=None, help="packed draft dir (default: the embedded target packed)")
    parser.add_argument("--validation", default=None, help="validation.jsonl (default: made from MT-bench)")
    parser.add_argument("--validation-tokens", type=int, default=128, help="target tokens per prompt when made")
    parser.add_argument("--points", type=int, default=512, help="evaluation points compared (at most)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the generate / speculative runs")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt in those runs")
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step in llama-cpp-python's speculation")
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="skip llama.cpp even when installed")
    parser.add_argument("--work-dir", default=None, help="exports, the packed self-draft, validation (default: temp)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    print("$", command(), flush=True)
    report = run(args)
    save_result("export", report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
