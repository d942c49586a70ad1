import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specdraft.core.wire import DRAFT_TOKENS
from specdraft.drafting.base import Drafter, NoDraft
from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.cached import CachedDraftModel
from specdraft.drafting.calibration import AcceptanceCalibration
from specdraft.drafting.hybrid import HybridDrafter
from specdraft.drafting.lookup import LookupDrafter, lookup_draft
from specdraft.drafting.spec import DrafterSpec
from specdraft.drafting.speculative import speculative_generate
from specdraft.model.decode import draft_batch, greedy_decode
from specdraft.model.forward import cache_kwargs, crop_cache
from specdraft.stages.speculate import SpeculateConfig, drafter_specs, in_process_settings, load_prompts, run_speculate

K_VALUES = [1, 2, 4, 8, 16]


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tiny_qwen3_dir, tiny_llama_dir):
    return _load(tiny_qwen3_dir), _load(tiny_llama_dir)


class AlwaysWrong(Drafter):
    """Knows the target's greedy continuation and proposes its next token plus one (mod vocab), then
    filler: every first draft token is rejected."""

    name = "wrong"

    def __init__(self, prompt, reference, vocab):
        self.prompt, self.reference, self.vocab = list(prompt), list(reference), vocab

    def draft(self, contexts, k):
        out = []
        for context in contexts:
            assert context[: len(self.prompt)] == self.prompt
            nxt = self.reference[len(context) - len(self.prompt)]
            out.append([(nxt + 1) % self.vocab] + [nxt] * (k - 1))
        return out


def _prompts(vocab, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 6, 15)]
    base = [rng.randrange(3, vocab) for _ in range(8)]
    prompts.append(base * 3)  # repetitive: the lookup drafter finds matches
    return prompts


def test_speculative_equals_greedy_for_every_drafter_and_k(models):
    target, other = models
    vocab = target.config.vocab_size
    proposers = {"self": CachedDraftModel(target),
                 "lookup": LookupDrafter(), "other-cached": CachedDraftModel(other),
                 "other-reprefill": ModelDrafter(other, max_batch_size=1),
                 "other-hybrid": HybridDrafter(CachedDraftModel(other), min_ngram=2)}
    n_new = 18
    for prompt in _prompts(vocab):
        ref = greedy_decode(target, [prompt], n_new, stop_at_eos=False)[0].tokens
        proposers["wrong"] = AlwaysWrong(prompt, ref, vocab)
        for k in K_VALUES:
            for name, prop in proposers.items():
                if name.startswith("other") and k not in (1, 4, 16):
                    continue  # a real but unrelated draft: slow (few tokens accepted); three k values do
                gen = speculative_generate(target, prop, prompt, n_new, k, eos_ids=set())
                assert gen.tokens == ref, (name, k, len(prompt))
                assert gen.accepted <= gen.drafted and gen.steps == len(gen.accepted_per_step)
                # every verify step yields its accepted drafts plus the target's own token
                assert len(gen.tokens) == 1 + gen.steps + gen.accepted
                if name == "self":  # always right: steps = ceil((n - 1) / (k + 1))
                    assert gen.accepted == gen.drafted
                    assert gen.steps == math.ceil((n_new - 1) / (k + 1))
                if name == "wrong":  # always wrong: one token per step, like plain greedy
                    assert gen.accepted == 0 and gen.steps == n_new - 1


def test_no_draft_is_plain_greedy(models):
    target, _ = models
    prompt = _prompts(target.config.vocab_size)[2]
    gen = speculative_generate(target, NoDraft(), prompt, 12, 4, eos_ids=set())
    assert gen.tokens == greedy_decode(target, [prompt], 12, stop_at_eos=False)[0].tokens
    assert gen.drafted == 0 and gen.steps == 11


def test_eos_inside_an_accepted_draft_stops_like_greedy(models):
    target, _ = models
    prompt = _prompts(target.config.vocab_size)[1]
    free = greedy_decode(target, [prompt], 20, stop_at_eos=False)[0].tokens
    eos = {free[6]}  # pretend the 7th greedy token is EOS
    ref = greedy_decode(target, [prompt], 20, eos_ids=eos)[0]
    for k in (1, 4, 16):
        gen = speculative_generate(target, CachedDraftModel(target), prompt, 20, k, eos_ids=eos)
        assert gen.tokens == ref.tokens and gen.finish_reason == ref.finish_reason == "eos"


def test_cached_draft_model_equals_draft_batch(models):
    _, draft = models
    rng = random.Random(5)
    cached = CachedDraftModel(draft)
    ctx = [rng.randrange(3, 300) for _ in range(5)]
    for _ in range(12):
        k = rng.choice([1, 3, 6])
        got = cached.draft_one(ctx, k)
        assert got == draft_batch(draft, [ctx], k)[0]
        # next context: some accepted drafts plus a bonus token (or an unrelated jump back)
        if rng.random() < 0.2:
            ctx = ctx[: rng.randrange(1, len(ctx) + 1)]
        else:
            ctx = ctx + got[: rng.randrange(0, k + 1)] + [rng.randrange(3, 300)]


def test_cached_int4_draft_catches_up_on_the_codes(tiny_llama_dir, int4_kernel_calls):
    """A catch-up of a few tokens (accepted drafts + the bonus token) runs on the int4 kernel, like a decode
    step, not on the dense bf16 copy the context prefill uses (4x the bytes at a few rows) -- through the lean
    forward and through the model's own (``server.engine.is_prefill``)."""
    from specdraft.model.loader import load_draft
    from specdraft.quant.linear import Int4Linear

    draft, _ = load_draft(tiny_llama_dir, "int4")
    body = [m for m in draft.modules() if isinstance(m, Int4Linear) and m.phase is not None]
    layers = draft.config.num_hidden_layers
    ctx = [5, 9, 14, 3, 22, 7]
    for lean in (True, False):
        cached = CachedDraftModel(draft, lean=lean)
        got = cached.draft_one(ctx, 3)
        with int4_kernel_calls() as calls:
            cached.draft_one(ctx + got + [11], 2)  # feeds got[-1] and 11: two tokens at positions 8, 9
        rows = [args[0].shape[0] for args in calls]
        head_calls = 2  # the head runs on the codes in every pass (one row per forward: logits_to_keep=1)
        # one call per body layer and pass; the lean forward fuses q/k/v into one call per layer where the fused
        # kernel gives the three calls' bits on this CPU (``model.lean``)
        per_pass = rows.count(2)
        assert per_pass in ((len(body), len(body) - 2 * layers) if lean else (len(body),)), (lean, rows)
        assert sorted(rows) == sorted([2] * per_pass + [1] * per_pass + [1] * head_calls), lean


def test_confident_draft_stops_after_its_first_unlikely_token(models):
    target, draft = models
    rng = random.Random(11)
    ctx = [rng.randrange(3, draft.config.vocab_size) for _ in range(7)]
    full = CachedDraftModel(draft).draft_one(ctx, 8)
    # the draft's own probability of each greedy token, recomputed without a cache
    probs = []
    with torch.inference_mode():
        for i in range(8):
            logits = draft(input_ids=torch.tensor([ctx + full[:i]])).logits[0, -1].float()
            probs.append(float(logits.softmax(-1).max()))
    for threshold in (0.0, 1.01, sorted(probs)[4]):
        got = CachedDraftModel(draft, min_confidence=threshold).draft_one(ctx, 8)
        stop = next((i + 1 for i, p in enumerate(probs) if p < threshold), 8)
        assert got == full[:stop], threshold
    assert len(CachedDraftModel(draft, min_confidence=1.01).draft_one(ctx, 8)) == 1
    # still lossless inside speculative decoding
    prompt = [rng.randrange(3, target.config.vocab_size) for _ in range(9)]
    ref = greedy_decode(target, [prompt], 20, stop_at_eos=False)[0].tokens
    gen = speculative_generate(target, CachedDraftModel(draft, min_confidence=0.5), prompt, 20, 6, eos_ids=set())
    assert gen.tokens == ref


def test_acceptance_calibration_counts_what_the_target_kept():
    cal = AcceptanceCalibration(bins=4, prior_weight=2.0)
    assert [cal.estimate(p) for p in (0.1, 0.3, 0.6, 0.9, 1.0)] == [0.125, 0.375, 0.625, 0.875, 0.875]
    cal.observe([0.1, 0.1, 0.1, 0.9], kept=2, refused=True)  # 2 kept, the third refused, the fourth unseen
    assert cal.estimate(0.1) == pytest.approx((0.25 + 2) / (2 + 3))
    assert cal.estimate(0.9) == 0.875
    cal.observe([0.9, 0.9], kept=2, refused=False)  # all kept (or the sequence ended): no refusal
    assert cal.estimate(0.9) == pytest.approx((1.75 + 2) / (2 + 2))


def test_calibrated_stop_learns_from_the_next_context(models):
    target, draft = models
    rng = random.Random(5)
    ctx = [rng.randrange(3, draft.config.vocab_size) for _ in range(7)]
    full = CachedDraftModel(draft).draft_one(ctx, 6)
    # a calibration that trusts every token drafts k; one that trusts none stops after the first
    trusting = CachedDraftModel(draft, min_confidence=0.5, stop="calibrated")
    trusting.calibration.kept = list(trusting.calibration.seen)
    assert trusting.draft_one(ctx, 6) == full
    doubting = CachedDraftModel(draft, min_confidence=0.5, stop="calibrated")
    doubting.calibration.kept = [0.0] * len(doubting.calibration.seen)
    assert doubting.draft_one(ctx, 6) == full[:1]
    # the next context keeps 3 of the 6 drafted tokens and then the target's own, different token
    seen = []
    trusting.calibration.observe = lambda probs, kept, refused: seen.append((len(probs), kept, refused))
    wrong = (full[3] + 1) % draft.config.vocab_size
    trusting.draft_one(ctx + full[:3] + [wrong], 2)
    assert seen == [(6, 3, True)]
    trusting.draft_one(ctx + full[:3] + [wrong] + [4, 4], 2)  # the previous 2-token draft: outcome read too
    assert len(seen) == 2
    trusting.reset()  # a new prompt: nothing to learn from the last draft of the old one
    trusting.draft_one(ctx, 2)
    assert len(seen) == 2
    # lossless inside speculative decoding, learning as it goes
    prompt = [rng.randrange(3, target.config.vocab_size) for _ in range(9)]
    ref = greedy_decode(target, [prompt], 20, stop_at_eos=False)[0].tokens
    learner = CachedDraftModel(draft, min_confidence=0.6, stop="calibrated")
    drafts, draft_one = [], learner.draft_one
    learner.draft_one = lambda context, k: drafts.append(draft_one(context, k)) or drafts[-1]
    gen = speculative_generate(target, learner, prompt, 20, 6, eos_ids=set())
    assert gen.tokens == ref
    observed = sum(learner.calibration.seen) - 2.0 * len(learner.calibration.seen)
    assert observed >= len(drafts) - 1  # every draft but the last was scored (one token at least)
    assert observed == sum(min(len(d), n + 1) for d, n in zip(drafts[:-1], gen.accepted_per_step))


def test_crop_cache(models):
    target, _ = models
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), use_cache=True, **cache_kwargs(target, cache))
    crop_cache(cache, 3)
    assert cache.get_seq_length() == 3
    crop_cache(cache, 10)
    assert cache.get_seq_length() == 3


def test_load_prompts_formats(tmp_path, tiny_qwen3_dir):
    from specdraft.model.chat import encode_prompts

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "Write a poem."},
            {"question_id": 81, "turns": ["What is 12 times 7?", "And 13?"]},
            {"id": "v", "category": "c", "offset": 0, "context_ids": [1, 2, 3], "target_ids": [4] * DRAFT_TOKENS},
            {"id": "v", "category": "c", "offset": DRAFT_TOKENS, "context_ids": [1, 2, 3, 4],
             "target_ids": [4] * DRAFT_TOKENS},
            {"id": "t", "prompt_ids": [7, 8]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(path, tok)
    assert [p.id for p in prompts] == ["a", "81", "v@0", "t"]
    assert prompts[0].ids == encode_prompts(tok, ["Write a poem."])[0]  # the templating traces uses
    assert tok.decode(prompts[0].ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompts[2].ids == [1, 2, 3] and prompts[3].ids == [7, 8]
    assert len(load_prompts(path, tok, limit=2)) == 2
    path.write_text(json.dumps({"id": "x", "text": "no prompt field"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: no prompt"):
        load_prompts(path, tok)
    for ids in ([1, -5], [1, len(tok)], [1, True], [1, 2.0]):  # ids the target could not embed
        path.write_text(json.dumps({"id": "t", "prompt_ids": ids}) + "\n")
        with pytest.raises(ValueError, match=r"p.jsonl:1: field 'prompt_ids' must be a non-empty list of token ids"):
            load_prompts(path, tok)


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    texts = ["Write a Python function that returns the sum of a list.", "The capital of France is Paris, and"]
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(texts)) + "\n")
    return path


def test_run_speculate_report_matches_recomputation(tmp_path, tiny_qwen3_dir, tiny_llama_dir, models):
    from specdraft.model.loader import load_draft

    target, _ = models
    out = tmp_path / "out"
    torch._dynamo.reset()  # the report's compiled draft and the recomputation's: within the recompile limit
    # the probability stop rule: the calibrated one (the default) learns over the whole run, in the rotated
    # order of prompts and k, which a recomputation per k does not replay
    cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft=str(tiny_llama_dir), prompts=_prompt_file(tmp_path),
                          out=out, max_new_tokens=12, k=[1, 3], warmup=False, draft_stop="probability",
                          draft_confidence=0.4, draft_compute="int4")
    assert run_speculate(cfg) == 0
    report = json.loads((out / "speculate.json").read_text())
    assert report["lossless"] and not report["mismatches"]
    assert set(report["drafters"]) == {"draft", "draft+lookup", "lookup"}
    assert report["provenance"]["drafters"]["draft"]["compute"] == "int4"  # as asked (the recomputation's)
    assert report["provenance"]["drafters"]["draft"]["min_confidence"] == cfg.draft_confidence == 0.4
    assert report["provenance"]["drafters"]["draft"]["stop"] == "probability"
    assert "stops a step's draft after a token it gives p < 0.4" in (out / "speculate.md").read_text()
    assert report["provenance"]["drafters"]["draft"]["compile"] is True and report["compile_errors"] == {}
    # accepted tokens per step recomputed independently from the same prompts
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompts = load_prompts(cfg.prompts, tok)
    int4_draft, _ = load_draft(tiny_llama_dir, "int4")
    for k in (1, 3):
        drafter = CachedDraftModel(int4_draft, min_confidence=cfg.draft_confidence, compile=True)
        gens = [speculative_generate(target, drafter, p.ids, 12, k) for p in prompts]
        row = report["drafters"]["draft"]["per_k"][str(k)]
        assert row["accepted_per_step"] == pytest.approx(sum(g.accepted for g in gens) / sum(g.steps for g in gens))
        assert row["tokens"] == sum(len(g.tokens) for g in gens)
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / report["baseline"]["tokens_per_s"])
        assert row["tokens_per_s"] == row["tokens_per_s_wall"] and row["tokens_per_s_cpu"] > 0  # clock: wall
        # the hybrid: same draft behind lookup, in its own proposer (own cache)
        hybrid = HybridDrafter(CachedDraftModel(int4_draft, min_confidence=cfg.draft_confidence, compile=True),
                                cfg.hybrid_min_ngram)
        gens = [speculative_generate(target, hybrid, p.ids, 12, k) for p in prompts]
        row = report["drafters"]["draft+lookup"]["per_k"][str(k)]
        assert row["accepted_per_step"] == pytest.approx(sum(g.accepted for g in gens) / sum(g.steps for g in gens))
        assert row["lookup_step_share"] == pytest.approx(hybrid.lookup_used / sum(g.steps for g in gens))
    best = report["drafters"]["draft"]
    assert best["best_k"] in (1, 3)
    assert best["best_tokens_per_s"] == max(r["tokens_per_s"] for r in best["per_k"].values())
    md = (out / "speculate.md").read_text()
    assert "tokens/s" in md and "identical to plain greedy" in md
    assert (out / "speculate_tokens_per_s.png").read_bytes()[:4] == b"\x89PNG"
    assert report["provenance"]["prompts_sha256"]


def test_run_speculate_flags_a_mismatch(tmp_path, tiny_qwen3_dir, monkeypatch):
    from specdraft.model.generation import Generation
    from specdraft.model.targets import TorchTarget

    def wrong_greedy(self, prompt, n):  # a "reference" that disagrees with the target
        return Generation([0] * n, "length")

    monkeypatch.setattr(TorchTarget, "greedy", wrong_greedy)
    cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft="lookup", prompts=_prompt_file(tmp_path),
                          out=tmp_path / "o", max_new_tokens=6, k=[2], warmup=False)
    assert run_speculate(cfg) == 1
    report = json.loads((tmp_path / "o" / "speculate.json").read_text())
    assert not report["lossless"] and report["mismatches"]


def test_run_speculate_keeps_its_measurements_when_rendering_fails(tmp_path, tiny_qwen3_dir, monkeypatch):
    import specdraft.stages.speculate as spec

    def broken_markdown(report):
        raise KeyError("a rendering bug")

    monkeypatch.setattr(spec, "speculate_markdown", broken_markdown)
    cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft="lookup", prompts=_prompt_file(tmp_path),
                          out=tmp_path / "o", max_new_tokens=6, k=[2, 4], warmup=False)
    with pytest.raises(KeyError, match="a rendering bug"):
        run_speculate(cfg)
    report = json.loads((tmp_path / "o" / "speculate.json").read_text())
    assert report["lossless"] and set(report["drafters"]["lookup"]["per_k"]) == {"2", "4"}
    assert "provenance" not in report  # the complete report is written once everything is rendered


def test_config_k_and_cli_alias(tmp_path):
    from specdraft.cli import stage_parser
    from specdraft.core.config import config_from_args

    parser, cls, _ = stage_parser("speculate")
    args = parser.parse_args(["--draft", "lookup", "--prompts", "p.jsonl", "-k", "16", "-k", "4"])
    cfg = config_from_args(cls, args)
    assert cfg.k == [4, 16] and cfg.baseline_lookup
    assert SpeculateConfig(draft="lookup", prompts="p").k == [2, 4, 8, 16]
    with pytest.raises(ValueError):
        SpeculateConfig(draft="lookup", prompts="p", k=[0])


def test_draft_lean_on_off_and_both(tiny_qwen3_dir, tiny_llama_dir):
    from specdraft.stages.speculate import build_drafters

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    by_name = {}
    for setting in ("on", "off", "both"):
        cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft=str(tiny_llama_dir), prompts="p", draft_lean=setting,
                              draft_confidence=0.0)  # always k: the two forwards compare over 4 tokens
        by_name[setting] = {d.name: (d.drafter, d.source) for d in build_drafters(cfg, tok)}
    assert by_name["on"]["draft"][0].lean is not None and by_name["off"]["draft"][0].lean is None
    assert set(by_name["both"]) == {"draft", "draft-hf", "draft+lookup", "lookup"}
    assert by_name["both"]["draft-hf"][0].lean is None and by_name["both"]["draft-hf"][1]["lean"] is False
    assert by_name["off"]["draft+lookup"][0].model_drafter.lean is None  # the hybrid's own draft follows the setting
    ctx = [5, 9, 14, 3, 22, 7, 40, 41]
    got = by_name["both"]["draft"][0].draft_one(ctx, 4)
    assert len(got) == 4 and got == by_name["both"]["draft-hf"][0].draft_one(ctx, 4)


def test_draft_compile_on_off_and_both(tiny_qwen3_dir, tiny_llama_dir):
    from specdraft.model.lean import CompiledSteps, LeanForward
    from specdraft.stages.speculate import build_drafters

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    by_name = {}
    for setting in ("on", "off", "both"):
        cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft=str(tiny_llama_dir), prompts="p",
                              draft_compile=setting)
        by_name[setting] = {d.name: (d.drafter, d.source) for d in build_drafters(cfg, tok)}
    assert SpeculateConfig(draft="lookup", prompts="p").draft_compile == "on"
    assert isinstance(by_name["on"]["draft"][0].lean, CompiledSteps) and by_name["on"]["draft"][1]["compile"]
    assert isinstance(by_name["off"]["draft"][0].lean, LeanForward) and not by_name["off"]["draft"][1]["compile"]
    assert set(by_name["both"]) == {"draft", "draft-eager", "draft+lookup", "lookup"}
    assert by_name["both"]["draft"][0].compiled and not by_name["both"]["draft-eager"][0].compiled
    # the hybrid's own draft follows the setting
    hybrid = {setting: by_name[setting]["draft+lookup"][0].model_drafter for setting in ("on", "off")}
    assert hybrid["on"].compiled and not hybrid["off"].compiled
    # without the lean forward there is nothing to compile
    off = SpeculateConfig(target=str(tiny_qwen3_dir), draft=str(tiny_llama_dir), prompts="p", draft_lean="off")
    draft = {d.name: d.drafter for d in build_drafters(off, tok)}["draft"]
    assert draft.lean is None and not draft.compiled


def test_drafter_specs_follow_the_config():
    """Which drafters a config asks for, in the report's order, and how each in-process one drafts."""
    def names(**fields):
        return [spec.name for spec in drafter_specs(SpeculateConfig(prompts="p", **fields))]

    assert names(draft="lookup") == ["lookup"]
    assert names(draft="none") == ["lookup"]
    assert names(draft="none", baseline_lookup=False) == []
    assert names(draft="http://127.0.0.1:8000") == ["server", "draft+lookup", "lookup"]
    server = drafter_specs(SpeculateConfig(prompts="p", draft="http://127.0.0.1:8000"))
    assert server[1] == DrafterSpec("server", behind_lookup=True)
    assert names(draft="d") == ["draft", "draft+lookup", "lookup"]
    assert names(draft="d", hybrid_min_ngram=None, baseline_lookup=False) == ["draft"]
    every = dict(draft="d", draft_cache="both", draft_stop="both", draft_lean="both", draft_compile="both",
                 also_draft=["other=o", "self=s"])
    assert names(**every) == ["draft", "draft-prob", "draft-eager", "draft-hf", "draft-reprefill", "draft+lookup",
                              "lookup", "other", "other-prob", "self", "self-prob"]
    assert names(draft="d", draft_lean="off", draft_compile="both") == ["draft", "draft+lookup", "lookup"]
    assert names(engine="llama.cpp", draft="d.gguf", also_draft=["big=b.gguf"]) == [
        "draft", "draft+lookup", "self", "big", "ngram", "lookup"]
    assert names(engine="llama.cpp", draft="lookup", self_draft=False, ngram_baseline=False,
                 baseline_lookup=False) == ["lookup"]
    with pytest.raises(ValueError, match="name 'ngram' is taken"):
        names(engine="llama.cpp", draft="none", also_draft=["ngram=x.gguf"])
    # how each in-process drafter drafts: the config's settings, its variant changing one of them
    cfg = SpeculateConfig(prompts="p", **every)
    settings = {spec.name: in_process_settings(cfg, spec) for spec in drafter_specs(cfg)
                if spec.role in ("draft", "self", "named") and not spec.behind_lookup}
    assert settings["draft"].record() == {"draft_cache": "keep", "lean": True, "compile": True, "stop": "calibrated",
                                          "min_confidence": 0.6}
    assert (settings["draft-prob"].stop, settings["draft-prob"].min_confidence) == ("probability", 0.4)
    assert (settings["draft-eager"].lean, settings["draft-eager"].compile) == (True, False)
    assert (settings["draft-hf"].lean, settings["draft-hf"].compile) == (False, False)
    assert settings["draft-reprefill"].record() == {"draft_cache": "reprefill"}
    assert settings["self"] == settings["draft"] and settings["other-prob"] == settings["draft-prob"]
    only = SpeculateConfig(prompts="p", draft="d", draft_cache="reprefill", also_draft=["other=o"])
    assert [in_process_settings(only, spec).cache for spec in drafter_specs(only)
            if spec.role in ("draft", "named")] == ["reprefill", "reprefill", "keep"]  # draft, its hybrid, also


def test_hybrid_drafter_asks_the_model_only_where_lookup_has_nothing():
    class Recorder(Drafter):
        name = "rec"

        def __init__(self):
            self.calls, self.resets = [], 0

        def reset(self):
            self.resets += 1

        def draft(self, contexts, k):
            self.calls += [list(c) for c in contexts]
            return [[7] * k for _ in contexts]

    rec = Recorder()
    hybrid = HybridDrafter(rec, min_ngram=2)
    repeat = [5, 6, 9, 1, 5, 6]  # the last two tokens (5, 6) occurred before, followed by 9, 1
    assert hybrid.draft_one(repeat, 3) == lookup_draft(repeat, 3, 4, 2) == [9, 1, 5]
    assert rec.calls == [] and hybrid.lookup_used == 1
    once = [5, 6, 9, 1, 2, 6]  # only the last token (6) recurs: below min_ngram, so the model drafts
    assert hybrid.draft_one(once, 3) == [7, 7, 7]
    assert rec.calls == [once] and hybrid.model_used == 1
    hybrid.reset()
    assert rec.resets == 1


def test_run_speculate_reports_a_failed_compile_and_stays_lossless(tmp_path, tiny_qwen3_dir, tiny_llama_dir,
                                                                   monkeypatch):
    import specdraft.model.lean as lean_module

    def broken_compile(fn):
        def run(*args, **kwargs):
            raise RuntimeError("InductorError: no working C++ compiler found")
        return run

    monkeypatch.setattr(lean_module.torch, "compile", broken_compile)
    out = tmp_path / "out"
    cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft=str(tiny_llama_dir), prompts=_prompt_file(tmp_path),
                          out=out, max_new_tokens=8, k=[2], warmup=False)
    assert run_speculate(cfg) == 0
    report = json.loads((out / "speculate.json").read_text())
    assert report["lossless"]
    why = "RuntimeError: InductorError: no working C++ compiler found"
    assert report["compile_errors"] == {"draft": why, "draft+lookup": why}  # one compiled forward, shared
    assert f"draft: torch.compile failed ({why}); its steps ran eagerly." in (out / "speculate.md").read_text()


def test_also_draft_runs_more_draft_models_in_the_same_sweep(tmp_path, tiny_qwen3_dir, tiny_llama_dir):
    """--also-draft NAME=DIR: another in-process draft, timed beside the main one against the same baseline."""
    from specdraft.cli import stage_parser
    from specdraft.core.config import config_from_args
    from specdraft.stages.speculate import build_drafters

    parser, cls, _ = stage_parser("speculate")
    args = parser.parse_args(["--draft", str(tiny_llama_dir), "--prompts", "p.jsonl",
                              "--also-draft", f"self={tiny_qwen3_dir}", "--also-draft", f"other={tiny_llama_dir}"])
    assert config_from_args(cls, args).also_draft == [f"self={tiny_qwen3_dir}", f"other={tiny_llama_dir}"]
    for bad in (["lookup=x"], ["draft=x"], ["noequals"], ["=x"], ["a=x", "a=y"]):
        with pytest.raises(ValueError, match="NAME=DIR"):
            SpeculateConfig(draft="lookup", prompts="p", also_draft=bad)
    cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft=str(tiny_llama_dir), prompts=_prompt_file(tmp_path),
                          out=tmp_path / "out", max_new_tokens=8, k=[2], warmup=False, draft_compile="off",
                          also_draft=[f"self={tiny_qwen3_dir}"], draft_compute="int4")
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    proposers = {d.name: (d.drafter, d.source) for d in build_drafters(cfg, tok)}
    assert list(proposers) == ["draft", "draft+lookup", "lookup", "self"]
    own, src = proposers["self"]
    assert isinstance(own, CachedDraftModel) and src["path"] == str(tiny_qwen3_dir) and src["compute"] == "int4"
    assert own.model is not proposers["draft"][0].model
    assert own.stop == "calibrated" and own.min_confidence == 0.6 and src["stop"] == "calibrated"
    # --draft-stop both: each in-process draft also with the probability rule, as NAME-prob
    both = {d.name: (d.drafter, d.source)
            for d in build_drafters(cfg.model_copy(update={"draft_stop": "both"}), tok)}
    assert list(both) == ["draft", "draft-prob", "draft+lookup", "lookup", "self", "self-prob"]
    for name in ("draft", "self"):
        calibrated, probability = both[name][0], both[f"{name}-prob"][0]
        assert (calibrated.stop, calibrated.min_confidence) == ("calibrated", 0.6)
        assert (probability.stop, probability.min_confidence, probability.calibration) == ("probability", 0.4, None)
        assert probability.model is calibrated.model and both[f"{name}-prob"][1]["stop"] == "probability"
    assert both["draft+lookup"][0].model_drafter.stop == "calibrated"
    with pytest.raises(ValueError, match="--also-draft gone"):
        build_drafters(cfg.model_copy(update={"also_draft": [f"gone={tmp_path / 'nope'}"]}), tok)
    assert run_speculate(cfg) == 0
    report = json.loads((tmp_path / "out" / "speculate.json").read_text())
    assert report["lossless"] and set(report["drafters"]) == {"draft", "draft+lookup", "lookup", "self"}
    assert report["provenance"]["drafters"]["self"]["path"] == str(tiny_qwen3_dir)
    # each drafter's spec beside its name: what it is, without parsing the name
    specs = {name: DrafterSpec.from_json(spec) for name, spec in report["drafter_specs"].items()}
    assert specs == {"draft": DrafterSpec("draft"), "draft+lookup": DrafterSpec("draft", behind_lookup=True),
                     "lookup": DrafterSpec("lookup"), "self": DrafterSpec("self")}
    markdown = (tmp_path / "out" / "speculate.md").read_text()
    assert "| self |" in markdown and "accepted (calibrated during the run) is < 0.6" in markdown


@pytest.mark.slow
def test_self_draft_of_the_embedded_target_is_exact_and_drafts_what_it_generates(tmp_path):
    """The demo's self-draft: the embedded SmolLM2 packed with its embedding in f16 keeps all 210 linear
    layers bit for bit (they sit on the GGUF's 4-bit grid), and as an int4 draft nearly every token it
    drafts is accepted; the output stays the target's greedy one."""
    from specdraft.model.chat import encode_prompts
    from specdraft.model.loader import load_draft
    from specdraft.model.specs import DEFAULT_TARGET, load_model, load_tokenizer
    from specdraft.stages.pack import PackConfig, run_pack

    out = run_pack(PackConfig(checkpoint=DEFAULT_TARGET, out=str(tmp_path / "self"), embedding_encoding="f16")).out
    target = load_model(DEFAULT_TARGET).eval()
    unpacked, _ = load_draft(out, "float32")
    want, got = target.state_dict(), unpacked.state_dict()
    linear = [n for n, m in target.named_modules() if isinstance(m, torch.nn.Linear) and m is not target.lm_head]
    assert len(linear) == 210 and all(torch.equal(want[f"{n}.weight"], got[f"{n}.weight"]) for n in linear)
    draft, _ = load_draft(out, "int4")
    tok = load_tokenizer(DEFAULT_TARGET)
    prompt = encode_prompts(tok, ["Write a Python function that reverses a string."])[0]
    gen = speculative_generate(target, CachedDraftModel(draft), prompt, 48, 8)
    assert gen.tokens == greedy_decode(target, [prompt], 48)[0].tokens
    assert gen.drafted >= 30 and gen.accepted / gen.drafted > 0.9, (gen.accepted, gen.drafted)


def test_repeats_report_the_speedup_of_every_pass(tmp_path, tiny_qwen3_dir):
    cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft="lookup", prompts=_prompt_file(tmp_path),
                          out=tmp_path / "o", max_new_tokens=6, k=[2, 4], warmup=False, repeats=3)
    assert run_speculate(cfg) == 0
    report = json.loads((tmp_path / "o" / "speculate.json").read_text())
    assert report["repeats"] == 3 and report["lossless"]
    rows = report["per_prompt"]
    assert sorted({r["repeat"] for r in rows}) == [0, 1, 2] and len(rows) == 3 * len({r["id"] for r in rows})
    for k, row in report["drafters"]["lookup"]["per_k"].items():
        passes = []
        for rep in range(3):  # each pass against the baseline of the same pass, recomputed from the rows
            mine = [r["runs"][f"lookup/k={k}"] for r in rows if r["repeat"] == rep]
            base = [r["runs"]["baseline"] for r in rows if r["repeat"] == rep]
            tokens = sum(r["new_tokens"] for r in rows if r["repeat"] == rep)
            passes.append((tokens / sum(m["seconds"] for m in mine)) / (tokens / sum(b["seconds"] for b in base)))
        assert row["speedup_repeats"] == pytest.approx(passes)
        assert row["speedup_range"] == [min(passes), max(passes)]
        assert min(passes) <= row["speedup_median"] <= max(passes)
    assert "median" in (tmp_path / "o" / "speculate.md").read_text()


def test_run_speculate_at_temperature_samples_against_plain_sampling(tmp_path, tiny_qwen3_dir, tiny_llama_dir, models):
    """--temperature: the same prompts and passes, drafts sampled from each drafter, the baseline plain sampling;
    seeded, so a run recomputed by hand with the recorded seeds gives the same counts."""
    from specdraft.model.sampling import SamplingParams

    target, draft = models
    cfg = SpeculateConfig(target=str(tiny_qwen3_dir), draft=str(tiny_llama_dir), prompts=_prompt_file(tmp_path),
                          out=tmp_path / "o", max_new_tokens=10, k=[2], warmup=False, draft_compute="float32",
                          draft_cache="reprefill", hybrid_min_ngram=None, predict=True, temperature=0.8, top_k=40,
                          seed=3)
    assert run_speculate(cfg) == 0
    report = json.loads((tmp_path / "o" / "speculate.json").read_text())
    assert report["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 40, "seed": 3}
    assert report["lossless"] is None and report["greedy_decode"] is None and report["prediction"] is None
    assert set(report["drafters"]) == {"draft", "lookup"}
    prompts = load_prompts(cfg.prompts, AutoTokenizer.from_pretrained(tiny_qwen3_dir))
    params = SamplingParams(temperature=0.8, top_k=40)
    gens = [speculative_generate(target, ModelDrafter(draft, max_batch_size=1), p.ids, 10, 2, sampling=params,
                                 generator=torch.Generator().manual_seed(row["seed"]))
            for p, row in zip(prompts, report["per_prompt"])]
    row = report["drafters"]["draft"]["per_k"]["2"]
    assert row["tokens"] == sum(len(g.tokens) for g in gens)
    assert row["acceptance_rate"] == pytest.approx(sum(g.accepted for g in gens) / sum(g.drafted for g in gens))
    md = (tmp_path / "o" / "speculate.md").read_text()
    assert "# Speculative sampling (temperature 0.8" in md and "Plain sampling" in md


def test_temperature_is_refused_where_sampling_cannot_be_lossless():
    with pytest.raises(ValueError, match="llama.cpp: its target gives greedy tokens only"):
        SpeculateConfig(draft="lookup", prompts="p", engine="llama.cpp", temperature=0.7)
    with pytest.raises(ValueError, match="--top-k in 1..64"):
        SpeculateConfig(draft="http://127.0.0.1:8000", prompts="p", temperature=0.7)
    assert SpeculateConfig(draft="http://127.0.0.1:8000", prompts="p", temperature=0.7, top_k=40).sampling.top_k == 40
    assert SpeculateConfig(draft="lookup", prompts="p", engine="llama.cpp").sampling.greedy
