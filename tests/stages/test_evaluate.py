import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fakes import JSONHandler, repeating_context, serve_http
from specdraft.core.io import RecordFileError
from specdraft.core.records import ValidationPoint, load_validation
from specdraft.drafting.acceptance import evaluate_drafter, percentile
from specdraft.drafting.base import Drafter, DrafterError
from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.lookup import LookupDrafter, lookup_draft
from specdraft.drafting.remote import HTTPDrafter
from specdraft.model.simple_decode import naive_greedy
from specdraft.stages.evaluate import EvalConfig, run_eval


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class ScriptedDrafter(Drafter):
    """Returns a fixed draft per context (keyed by the context's first token)."""

    name = "scripted"

    def __init__(self, drafts):
        self.drafts = drafts

    def draft(self, contexts, n):
        return [self.drafts[c[0]] for c in contexts]


def _points_by_hand():
    # (prompt id, category, target, draft) -> accepted length worked out by hand
    t = list(range(100, 116))
    cases = [
        ("a", "code", t, t, 16),                           # all accepted
        ("a", "code", t, [0] + t[1:], 0),                  # first token wrong
        ("a", "code", t, t[:3] + [0] + t[4:], 3),          # wrong at position 4
        ("b", "chat", t, t[:5], 5),                        # short draft (lookup): missing = rejected
        ("c", "chat", t, [], 0),                           # no draft at all
        ("c", "chat", t, t + [1, 2, 3], 16),               # longer than k: only k scored
    ]
    points, drafts, expect = [], {}, []
    for i, (pid, cat, target, draft, a) in enumerate(cases):
        points.append(ValidationPoint(id=pid, category=cat, offset=16 * i, context_ids=[i, 7, 8], target_ids=target))
        drafts[i] = draft
        expect.append(a)
    return points, ScriptedDrafter(drafts), expect


def test_evaluate_drafter_matches_hand_computation():
    points, drafter, expect = _points_by_hand()
    r = evaluate_drafter(drafter, points, k=16, batch_size=4)
    assert [p["accepted"] for p in r["per_point"]] == expect
    assert r["points"] == 6 and r["prompts"] == 3
    assert r["mean_accepted_pooled"] == pytest.approx(sum(expect) / 6)
    # per prompt: a = (16+0+3)/3, b = 5, c = (0+16)/2 -> mean of the three means
    assert r["mean_accepted_per_prompt"] == pytest.approx(((16 + 0 + 3) / 3 + 5 + 8) / 3)
    hist = [0] * 17
    for a in expect:
        hist[a] += 1
    assert r["histogram"] == hist
    cum = [sum(a > i for a in expect) / 6 for i in range(16)]
    assert r["cumulative_acceptance"] == pytest.approx(cum)
    cond = [sum(a > i for a in expect) / max(1, sum(a >= i for a in expect)) for i in range(16)]
    assert r["conditional_acceptance"] == pytest.approx(cond)
    assert r["conditional_support"] == [6] + [sum(a > i for a in expect) for i in range(15)]
    # per category: counts exact, the pooled mean and the mean of its prompts' means (chat: b = 5, c = (0+16)/2)
    assert r["per_category"] == {
        "chat": {"points": 3, "prompts": 2, "accepted_total": 21, "mean_accepted": pytest.approx(21 / 3),
                 "mean_accepted_per_prompt": pytest.approx((5 + 8) / 2)},
        "code": {"points": 3, "prompts": 1, "accepted_total": 19, "mean_accepted": pytest.approx(19 / 3),
                 "mean_accepted_per_prompt": pytest.approx(19 / 3)}}
    # every context is 3 tokens long: one bucket holding them all
    assert list(r["per_context_length"]) == ["<256"] and r["per_context_length"]["<256"]["accepted_total"] == 40
    assert [p["context_tokens"] for p in r["per_point"]] == [3] * 6
    assert r["tokens_per_verify_step"] == pytest.approx(1 + sum(expect) / 6)
    assert r["latency"]["calls"] == 2 and r["latency"]["unit"].startswith("call")


def test_evaluate_drafter_accepts_jsonl_dicts_and_smaller_k():
    points, drafter, _ = _points_by_hand()
    dicts = [{"id": p.id, "category": p.category, "offset": p.offset, "context_ids": p.context_ids,
              "target_ids": p.target_ids} for p in points]
    r = evaluate_drafter(drafter, dicts, k=4)
    assert [p["accepted"] for p in r["per_point"]] == [4, 0, 3, 4, 0, 4]
    assert len(r["histogram"]) == 5


def test_model_drafter_recomputed_with_naive_greedy(tiny_qwen3_dir, tiny_llama_dir):
    target = _load(tiny_qwen3_dir)
    draft = _load(tiny_llama_dir)  # same tokenizer, unrelated weights
    rng = random.Random(0)
    points = []
    for i, n in enumerate([3, 9, 14, 5]):
        ctx = [rng.randrange(3, target.config.vocab_size) for _ in range(n)]
        greedy = naive_greedy(target, ctx, 16, stop_at_eos=False).tokens
        points.append(ValidationPoint(f"p{i % 2}", "x", 0, ctx, greedy))
    # the target as its own drafter accepts everything
    same = evaluate_drafter(ModelDrafter(target, "self"), points, k=16)
    assert same["histogram"][16] == 4 and same["mean_accepted_pooled"] == 16
    # an unrelated draft: accepted lengths recomputed by hand from its naive greedy drafts
    r = evaluate_drafter(ModelDrafter(draft, "d", max_batch_size=3), points, k=16)
    by_hand = []
    for p in points:
        d = naive_greedy(draft, p.context_ids, 16, stop_at_eos=False).tokens
        a = 0
        while a < 16 and d[a] == p.target_ids[a]:
            a += 1
        by_hand.append(a)
    assert [x["accepted"] for x in r["per_point"]] == by_hand


class _DraftHandler(JSONHandler, BaseHTTPRequestHandler):
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    contexts: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.contexts.append(body["token_ids"])
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        time.sleep(0.05)
        with cls.lock:
            cls.in_flight -= 1
        if body["token_ids"][0] == 999:
            payload, code = {"error": "validation_error", "details": [{"field": "token_ids[0]"}]}, 422
        else:
            payload, code = {"draft_ids": lookup_draft(body["token_ids"], body["num_tokens"]), "model": "fake"}, 200
        self.send_json(code, payload)


@pytest.fixture
def fake_server():
    yield from serve_http(_DraftHandler)


def _lookup_points(n=12):
    rng = random.Random(1)
    pts = []
    for i in range(n):
        ctx = repeating_context(rng, 10, 12, 4)
        target = ctx[4:10] + [rng.randrange(5, 12) for _ in range(10)]
        pts.append(ValidationPoint(f"q{i % 4}", f"c{i % 3}", 0, ctx, target))
    return pts


def test_http_drafter_concurrent_and_same_numbers_as_in_process(fake_server):
    points = _lookup_points()
    with HTTPDrafter(fake_server, concurrency=4) as http:
        r = evaluate_drafter(http, points, k=16)
        assert http.name == "fake"
    local = evaluate_drafter(LookupDrafter(), points, k=16)
    assert [p["accepted"] for p in r["per_point"]] == [p["accepted"] for p in local["per_point"]]
    assert r["histogram"] == local["histogram"]
    assert r["latency"]["unit"].startswith("request") and r["latency"]["calls"] == len(points)
    assert r["latency"]["p50_ms"] >= 40 and r["latency"]["p99_ms"] >= r["latency"]["p50_ms"]
    assert _DraftHandler.peak > 1  # requests really were in flight together


def test_http_drafter_errors_name_the_server(fake_server):
    with HTTPDrafter(fake_server, concurrency=2) as http:
        with pytest.raises(DrafterError, match="HTTP 422"):
            http.draft([[999, 1]], 4)
    with HTTPDrafter("http://127.0.0.1:9", concurrency=1, timeout=2) as http:
        with pytest.raises(DrafterError, match="request failed"):
            http.draft([[1]], 4)


def test_percentile_matches_numpy():
    rng = random.Random(2)
    xs = [rng.random() for _ in range(37)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def _write_validation(path, points):
    with open(path, "w") as f:
        for p in points:
            f.write(json.dumps({"id": p.id, "category": p.category, "offset": p.offset,
                                "context_ids": p.context_ids, "target_ids": p.target_ids}) + "\n")
    return path


def test_load_validation_errors_name_file_line_and_field(tmp_path):
    good = {"id": "a", "category": "c", "offset": 0, "context_ids": [1, 2], "target_ids": list(range(16))}
    cases = [
        ({k: v for k, v in good.items() if k != "context_ids"}, "context_ids"),
        ({**good, "target_ids": [1, 2]}, "target_ids"),
        ({**good, "context_ids": [1, "x"]}, "context_ids"),
        ({**good, "context_ids": []}, "context_ids"),
        ({**good, "offset": None}, "offset"),
        ({**good, "offset": "16"}, "offset"),
        ({**good, "offset": 1.5}, "offset"),
        ({**good, "offset": -16}, "offset"),
    ]
    for obj, field in cases:
        path = tmp_path / "v.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(obj) + "\n")
        with pytest.raises(RecordFileError, match=rf"v.jsonl:2.*{field}"):
            load_validation(path)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(RecordFileError, match="v.jsonl:2: not valid JSON"):
        load_validation(path)
    path.write_bytes(json.dumps(good).encode() + b'\n{"id": "\xff"}\n')
    with pytest.raises(ValueError, match="v.jsonl:2: not UTF-8 text"):
        load_validation(path)
    assert len(load_validation(path, limit=1)) == 1


def test_config_needs_exactly_one_drafter(tmp_path):
    with pytest.raises(ValueError, match="exactly one drafter"):
        EvalConfig(validation=tmp_path / "v", out=tmp_path)
    with pytest.raises(ValueError, match="exactly one drafter"):
        EvalConfig(validation=tmp_path / "v", out=tmp_path, lookup=True, server="http://x")


def test_run_eval_lookup_writes_report(tmp_path):
    points = _lookup_points()
    v = _write_validation(tmp_path / "validation.jsonl", points)
    out = tmp_path / "report"
    assert run_eval(EvalConfig(validation=v, out=out, lookup=True, temperatures=[])) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["acceptance_at_temperature"] is None
    expect = evaluate_drafter(LookupDrafter(), points, k=16)
    for key in ("mean_accepted_pooled", "mean_accepted_per_prompt", "histogram", "per_category",
                "cumulative_acceptance", "conditional_acceptance"):
        assert report[key] == expect[key], key
    md = (out / "report.md").read_text()
    assert "pooled over points" in md and "per-prompt mean" in md
    for png in ("acceptance_per_position.png", "accepted_length_histogram.png", "acceptance_per_category.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert report["provenance"]["files"][png]
    assert report["provenance"]["validation_sha256"]


def test_cli_eval_model_dir(tiny_qwen3_dir, tmp_path):
    from specdraft.cli import main

    target = _load(tiny_qwen3_dir)
    rng = random.Random(4)
    points = []
    for i in range(5):
        ctx = [rng.randrange(3, 300) for _ in range(6)]
        tgt = naive_greedy(target, ctx, 16, stop_at_eos=False).tokens
        if i % 2:
            tgt = tgt[:7] + [(tgt[7] + 1) % 300] + tgt[8:]  # the target "disagrees" at position 8
        points.append(ValidationPoint(f"p{i}", "x", 0, ctx, tgt))
    v = _write_validation(tmp_path / "validation.jsonl", points)
    out = tmp_path / "r"
    assert main(["eval", "--validation", str(v), "--model-dir", str(tiny_qwen3_dir), "--out", str(out),
                 "--batch-size", "2", "--target", str(tiny_qwen3_dir), "--temperatures", "0", "--temperatures",
                 "0.7"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [p["accepted"] for p in report["per_point"]] == [16, 7, 16, 7, 16]
    assert report["drafter_source"]["format"] == "hf"
    # the target as its own draft: temperature 0 is the greedy figure exactly; at 0.7 q = p wherever the
    # continuation is the target's own (every position of the even points), so all 16 are expected there
    section = report["acceptance_at_temperature"]
    assert [p["0.0"] for p in section["per_point"]] == [16, 7, 16, 7, 16]
    assert section["temperatures"]["0.0"]["mean_expected_accepted_pooled"] == report["mean_accepted_pooled"]
    assert [p["0.7"] for p in section["per_point"]][0::2] == pytest.approx([16] * 3, abs=1e-4)
    assert (out / "acceptance_per_position_T0.7.png").is_file()
    md = (out / "report.md").read_text()
    assert "Acceptance at temperature" in md and "| 0.7 |" in md


def test_hybrid_drafter_recomputed_point_by_point(tiny_qwen3_dir, tmp_path):
    """--hybrid-min-ngram: each point scores lookup's draft where the context's last 2+ tokens recur, the
    model's draft elsewhere (both recomputed here independently), and the report counts each side."""
    from specdraft.cli import main

    target = _load(tiny_qwen3_dir)
    rng = random.Random(7)
    points = []
    for i in range(8):
        ctx = [rng.randrange(3, 300) for _ in range(7)]
        if i % 2:
            ctx = ctx + ctx[:3] + ctx[:2]  # the last two tokens occurred before: lookup answers
        tgt = naive_greedy(target, ctx, 16, stop_at_eos=False).tokens
        points.append(ValidationPoint(f"p{i // 2}", "x", i, ctx, tgt))
    v = _write_validation(tmp_path / "validation.jsonl", points)
    out = tmp_path / "r"
    assert main(["eval", "--validation", str(v), "--model-dir", str(tiny_qwen3_dir), "--out", str(out),
                 "--hybrid-min-ngram", "2", "--target", str(tiny_qwen3_dir)]) == 0
    report = json.loads((out / "report.json").read_text())
    expect, looked_up = [], 0
    for p in points:
        copied = lookup_draft(p.context_ids, 16, 4, 2)
        draft = copied or naive_greedy(target, p.context_ids, 16, stop_at_eos=False).tokens
        looked_up += bool(copied)
        a = 0
        while a < 16 and a < len(draft) and draft[a] == p.target_ids[a]:
            a += 1
        expect.append(a)
    assert [p["accepted"] for p in report["per_point"]] == expect
    assert looked_up == 4 and report["hybrid"] == {"min_ngram": 2, "lookup_points": 4, "model_points": 4}
    assert expect[0::2] == [16] * 4  # the model is the target itself: exact where it drafts
    assert report["drafter_source"]["kind"] == "hybrid" and "+lookup2" in report["drafter"]
    assert "drafted by prompt lookup" in (out / "report.md").read_text()
    with pytest.raises(ValueError, match="not --lookup"):
        EvalConfig(validation=v, out=out, lookup=True, hybrid_min_ngram=2)


def test_run_eval_hybrid_over_http_sends_only_what_lookup_cannot_answer(fake_server, tmp_path):
    rng = random.Random(3)
    points = []
    for i in range(8):
        ctx = [100 + 20 * i + j for j in range(6)]  # all distinct: lookup has nothing, the server drafts
        if i % 2:
            ctx = ctx + ctx[:2]  # the last two tokens occurred before: lookup answers, no request
        points.append(ValidationPoint(f"p{i}", "x", 0, ctx, [rng.randrange(100, 300) for _ in range(16)]))
    v = _write_validation(tmp_path / "validation.jsonl", points)
    _DraftHandler.contexts = []
    out = tmp_path / "r"
    assert run_eval(EvalConfig(validation=v, server=fake_server, out=out, hybrid_min_ngram=2, plots=False)) == 0
    report = json.loads((out / "report.json").read_text())
    assert sorted(_DraftHandler.contexts) == sorted(p.context_ids for p in points[0::2])
    assert report["hybrid"] == {"min_ngram": 2, "lookup_points": 4, "model_points": 4}
    assert report["latency"]["unit"].startswith("request") and report["latency"]["calls"] == 4
    assert report["drafter_source"] == {"kind": "hybrid", "min_ngram": 2,
                                        "model": {"kind": "http", "url": fake_server}}
    # the server answers drafts, not distributions: acceptance at temperature is skipped, and says why
    assert report["acceptance_at_temperature"]["skipped"]["temperatures"] == [0.0, 0.7, 1.0]
    assert "--pack-dir" in (out / "report.md").read_text()


@pytest.mark.parametrize("hybrid", [None, 2])
def test_run_eval_server_at_temperature_uses_the_served_pack_in_process(fake_server, tiny_qwen3_dir, tmp_path,
                                                                        hybrid):
    """--server with --pack-dir: greedy figures from the server, the distributions at temperature from the pack
    loaded here (and the report says so); the same figures as --model-dir on that pack computes."""
    target = _load(tiny_qwen3_dir)
    rng = random.Random(9)
    points = []
    for i in range(4):
        ctx = [rng.randrange(3, 300) for _ in range(5 + i)]
        points.append(ValidationPoint(f"p{i}", "x", 0, ctx, naive_greedy(target, ctx, 16, stop_at_eos=False).tokens))
    v = _write_validation(tmp_path / "validation.jsonl", points)
    common = dict(validation=v, target=str(tiny_qwen3_dir), temperatures=[0.7], plots=False, compute="float32",
                  hybrid_min_ngram=hybrid)
    assert run_eval(EvalConfig(server=fake_server, pack_dir=tiny_qwen3_dir, out=tmp_path / "s", **common)) == 0
    assert run_eval(EvalConfig(model_dir=tiny_qwen3_dir, out=tmp_path / "m", **common)) == 0
    served, local = (json.loads((tmp_path / d / "report.json").read_text())["acceptance_at_temperature"]
                     for d in ("s", "m"))
    assert served["temperatures"] == local["temperatures"]
    assert served["draft_distributions"]["served_by"] == fake_server
    assert "the pack the server serves" in (tmp_path / "s" / "report.md").read_text()
    with pytest.raises(ValueError, match="--pack-dir names the pack a --server serves"):
        EvalConfig(model_dir=tiny_qwen3_dir, pack_dir=tiny_qwen3_dir, out=tmp_path, validation=v)


def test_run_eval_chooses_the_hybrid_rule_on_half_the_prompts(tiny_qwen3_dir, tmp_path):
    """--choose-hybrid-rule: the model drafts at every point (its figures are the report's), lookup is scored
    beside it, and the rule chosen on every other prompt of each category is reported on the others, per category
    and context length, in the record and the markdown."""
    from specdraft.drafting.hybrid_rule import HybridRule

    target = _load(tiny_qwen3_dir)
    rng = random.Random(11)
    points = []
    for i in range(8):
        ctx = [rng.randrange(3, 300) for _ in range(12)]
        if i % 2:  # the answer restates the context: lookup copies it, the model does not
            ctx = ctx + ctx[:4]
            points.append(ValidationPoint(f"copy{i}", "copy", 0, ctx, ctx[4:12] + ctx[:8]))
        else:  # the model is the target: exact
            points.append(ValidationPoint(f"new{i}", "new", 0, ctx, naive_greedy(target, ctx, 16,
                                                                                 stop_at_eos=False).tokens))
    v = _write_validation(tmp_path / "validation.jsonl", points)
    out = tmp_path / "r"
    assert run_eval(EvalConfig(validation=v, model_dir=tiny_qwen3_dir, out=out, compute="float32",
                               choose_hybrid_rule=True, temperatures=[])) == 0
    report = json.loads((out / "report.json").read_text())
    model = [p["accepted"] for p in report["per_point"]]
    assert model[0::2] == [16] * 4  # the report's own figures stay the model's
    section = report["hybrid_rule"]
    assert section["split"]["calibration"] == {"points": 4, "prompts": 4}
    rule = HybridRule.from_json(section["chosen"])
    lookup = [(p["lookup_accepted"], p["lookup_match"]) for p in report["per_point"]]
    # lookup copies what followed the first 4 tokens: 12 tokens, all the target's
    assert all(m >= 4 for _, m in lookup[1::2]) and all(a == 12 for a, _ in lookup[1::2])
    # by hand on the reported prompts (the 2nd and 4th of each category)
    reported = [i for i in range(8) if (i // 2) % 2 == 1]
    by_hand = [lookup[i][0] if lookup[i][1] and rule.uses_lookup(lookup[i][1], points[i].category) else model[i]
               for i in reported]
    assert section["reported"]["overall"]["chosen"]["accepted_total"] == sum(by_hand) == 56
    assert section["reported"]["per_category"]["copy"]["lookup_alone"]["accepted_total"] == 24
    assert section["reported"]["per_category"]["new"]["draft_only"]["accepted_total"] == 32
    ceiling = section["ceiling"]["key"]
    assert section["reported"]["overall"][ceiling]["accepted_total"] == sum(max(model[i], lookup[i][0])
                                                                             for i in reported)
    md = (out / "report.md").read_text()
    assert "the rule measured" in md and "## Per context length" in md and "| <256 |" in md
    assert "the better of the two per point" in md
    # the chosen rule against the better of the two: lookup in "copy", the model in "new", each of 2 prompts
    against = section["reported"]["per_category"]["copy"]["against_better"]
    assert against["better"] == "lookup_alone" and against["prompts"] == 2 and not against["below"]
    assert "(2 prompt(s): no interval) against lookup" in md and "beyond its 90% interval over prompts in 0" in md
    assert (out / "acceptance_per_context_length.png").is_file()
    # the model in process: the guided rules are candidates, each point's predictions recorded; the guided rule's
    # gain over the plain one on calibration (lookup's copy is the whole answer there: nothing to gain) is no reason
    assert "guided_0.1_match_1" in section["candidates"] and "guided by lookup (ratio 0.1)" in md
    assert all(set(p["guided_predicted"]) == {"0.03", "0.1", "0.3"} for p in report["per_point"][1::2])
    assert section["guided_against_plain"]["above"] is False and not rule.guided
    for bad in (dict(lookup=True), dict(model_dir=tiny_qwen3_dir, hybrid_min_ngram=2)):
        with pytest.raises(ValueError, match="--choose-hybrid-rule"):
            EvalConfig(validation=v, out=out, choose_hybrid_rule=True, **bad)
