import json
import logging
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from processes import kill_once_written
from specdraft.audit.config import AuditConfig
from specdraft.audit.context import AuditContext
from specdraft.audit.traces import audit_traces
from specdraft.cli import main
from specdraft.core.io import RecordFileError, jsonl_line, repair_jsonl, sha256_file
from specdraft.core.records import read_prompts
from specdraft.model.chat import encode_prompts
from specdraft.model.decode import greedy_decode
from specdraft.model.generation import Generation
from specdraft.model.simple_decode import naive_greedy
from specdraft.model.trace_backend import TraceBackend
from specdraft.model.trace_vllm import VLLMBackend, vllm_generation
from specdraft.stages.traces import (
    MergeTracesConfig,
    TracesConfig,
    ValidationConfig,
    evaluation_points,
    parse_shard,
    run_merge_traces,
    run_traces,
    run_validation,
)

TEXTS = ["Write a Python function that returns the sum of a list.", "What is 12 times 7?",
         "Translate good morning into French.", "Explain speculative decoding.", "Once upon a time",
         "The capital of France is", "for i in range(10):", "Summarise the following paragraph."]


def _write_prompts(path: Path, n: int, repeat_long: bool = False) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            text = TEXTS[i % len(TEXTS)] + (" Please answer in detail." * (i % 3) if repeat_long else "")
            f.write(json.dumps({"id": f"p{i}", "source": "code" if i % 2 else "chat", "prompt": text}) + "\n")
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    return tiny_qwen3_dir, model, AutoTokenizer.from_pretrained(tiny_qwen3_dir)


def _expected(tiny, texts, max_new):
    _, model, tok = tiny
    ids = encode_prompts(tok, texts)
    return ids, [greedy_decode(model, [p], max_new)[0] for p in ids]


# --------------------------------------------------------------------------------------------- inputs

def test_read_prompts_formats_and_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "source": "s", "prompt": "hi"}\n\n{"id": 7, "prompt": "yo"}\n')
    recs = read_prompts(p)
    assert [(r.id, r.source, r.text) for r in recs] == [("a", "s", "hi"), ("7", "unknown", "yo")]
    mt = tmp_path / "mt.jsonl"
    mt.write_text('{"question_id": 81, "category": "writing", "turns": ["first", "second"]}\n')
    (rec,) = read_prompts(mt)
    assert (rec.id, rec.category, rec.text) == ("81", "writing", "first")
    for bad, msg in [('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "duplicate id"),
                     ('{"id": "a"}\n', "missing field 'prompt'"), ("{oops\n", "not valid JSON"),
                     ('{"id": "a", "prompt": "  "}\n', "non-empty")]:
        p.write_text(bad)
        with pytest.raises(RecordFileError, match=msg) as e:
            read_prompts(p)
        assert str(p) in str(e.value)


def test_encode_prompts_uses_template_without_thinking(tiny):
    _, _, tok = tiny
    (ids,) = encode_prompts(tok, ["hello"])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nhello<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    raw_tok = AutoTokenizer.from_pretrained(tiny[0])
    raw_tok.chat_template = None
    assert encode_prompts(raw_tok, ["hello"]) == [raw_tok("hello").input_ids]


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4)
    for bad in ["4/4", "x", "1/0"]:
        with pytest.raises(ValueError):
            parse_shard(bad)


# --------------------------------------------------------------------------------------------- traces

def test_threads_set_torchs_threads_for_the_hf_backend_and_its_record_says_so(tiny, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "run" / "traces.jsonl"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=out, max_new_tokens=4, threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    summary = json.loads((tmp_path / "run" / "traces.summary.json").read_text())
    assert summary["this_run"]["backend"] == "hf" and summary["this_run"]["torch_threads"] == 1
    assert summary["config"]["threads"] == 1


def test_traces_rows_equal_single_row_greedy(tiny, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 7, repeat_long=True)
    out = tmp_path / "run" / "traces.jsonl"
    res = run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=out, max_new_tokens=12, batch_size=3))
    rows = {r["id"]: r for r in _rows(out)}
    texts = [r.text for r in read_prompts(prompts)]
    ids, gens = _expected(tiny, texts, 12)
    assert sorted(rows) == [f"p{i}" for i in range(7)]
    for i in range(7):
        row = rows[f"p{i}"]
        assert set(row) == {"id", "source", "prompt_ids", "completion_ids", "finish_reason"}
        assert row["prompt_ids"] == ids[i]
        assert row["completion_ids"] == gens[i].tokens and row["finish_reason"] == gens[i].finish_reason
    summary = json.loads((tmp_path / "run" / "traces.summary.json").read_text())
    assert summary["status"] == "complete" and summary["rows"] == 7 == res.rows
    assert sum(summary["finish_reasons"].values()) == 7
    assert summary["completion_tokens"] == sum(len(g.tokens) for g in gens)
    assert summary["target"]["weights_sha256"] and summary["prompts"]["sha256"]
    assert summary["chat_template"] is True and summary["this_run"]["completion_tokens_per_s"] > 0
    assert summary["traces_sha256"] == __import__("hashlib").sha256(out.read_bytes()).hexdigest()
    assert (tmp_path / "run" / "traces.log").read_text().count("decoded 7 prompts") == 1


def test_traces_without_chat_template_use_raw_prompts(tiny, tmp_path, caplog):
    raw_dir = tmp_path / "raw_model"
    shutil.copytree(tiny[0], raw_dir)
    (raw_dir / "chat_template.jinja").unlink()
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 2)
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        res = run_traces(TracesConfig(target=str(raw_dir), prompts=prompts, out=tmp_path / "t.jsonl",
                                      max_new_tokens=2))
    assert "no chat template" in caplog.text and res.summary_data["chat_template"] is False
    assert _rows(tmp_path / "t.jsonl")[0]["prompt_ids"] == tiny[2](TEXTS[0]).input_ids


def test_traces_resume_after_torn_line(tiny, tmp_path, caplog):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 6)
    out = tmp_path / "traces.jsonl"
    cfg = dict(target=str(tiny[0]), prompts=prompts, out=out, max_new_tokens=6, batch_size=2)
    run_traces(TracesConfig(**cfg))
    full = {r["id"]: r for r in _rows(out)}
    # A killed run: three complete lines and half of the fourth.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        res = run_traces(TracesConfig(**cfg))
    assert "torn last line" in caplog.text
    assert res.new_prompts == 3
    rows = _rows(out)
    assert Counter(r["id"] for r in rows) == Counter(list(full))  # every id exactly once
    assert {r["id"]: r for r in rows} == full
    last = run_traces(TracesConfig(**cfg))
    assert last.new_prompts == 0  # nothing left to do
    assert [r["prompts"] for r in last.summary_data["runs"]] == [6, 3, 0]


def test_resuming_over_a_foreign_row_is_refused_before_decoding(tiny, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 4)
    out = tmp_path / "traces.jsonl"
    cfg = dict(target=str(tiny[0]), prompts=prompts, out=out, max_new_tokens=4, batch_size=2)
    run_traces(TracesConfig(**cfg, limit=2))
    written = out.read_text()
    for row, says in [('["p9"]', "a JSON object with a string 'id'"), ('{"id": ["p9"]}', "string 'id'"),
                      ('{"id": "p9", "prompt_ids": 5, "completion_ids": [1], "finish_reason": "eos"}',
                       r"field\(s\) \['prompt_ids'\] missing or of the wrong type"),
                      ('{"id": "p9", "prompt_ids": [5], "completion_ids": [1]}', r"\['finish_reason'\]")]:
        out.write_text(written + row + "\n")
        with pytest.raises(RecordFileError, match=f"traces.jsonl:3: .*{says}"):
            run_traces(TracesConfig(**cfg))
        assert out.read_text() == written + row + "\n"  # nothing decoded, nothing lost


def test_traces_killed_subprocess_resumes(tiny, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 24)
    out = tmp_path / "traces.jsonl"
    args = ["traces", "--target", str(tiny[0]), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "8", "--batch-size", "2", "--device", "cpu"]
    # Slow each decode step down so that the kill lands mid-run.
    code = ("import sys, time, specdraft.model.slot_engine as d\n"
            "step = d.SlotDecoder.step\n"
            "d.SlotDecoder.step = lambda self: (time.sleep(0.05), step(self))[1]\n"
            "from specdraft.cli import main\n"
            f"sys.exit(main({args!r}))\n")
    before = kill_once_written(code, [], out, lines=4, timeout_s=120)
    assert 4 <= before < 24
    res = run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=out, max_new_tokens=8, batch_size=2))
    rows = _rows(out)
    assert res.new_prompts == 24 - before
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(24))  # no duplicate, none lost
    texts = [r.text for r in read_prompts(prompts)]
    _, gens = _expected(tiny, texts, 8)
    assert all(r["completion_ids"] == gens[int(r["id"][1:])].tokens for r in rows)


def test_traces_shards_limit_and_settings_guard(tiny, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 9)
    ids = []
    for i in range(2):
        out = tmp_path / f"shard{i}" / "traces.jsonl"
        run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=out, max_new_tokens=3, limit=7,
                                shard=f"{i}/2"))
        ids.append([r["id"] for r in _rows(out)])
    assert sorted(ids[0]) == ["p0", "p2", "p4", "p6"] and sorted(ids[1]) == ["p1", "p3", "p5"]
    empty = run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=tmp_path / "none" / "traces.jsonl",
                                    max_new_tokens=3, limit=1, shard="1/2"))  # this shard gets no prompt
    assert empty.rows == 0 and empty.summary_data["status"] == "complete"
    with pytest.raises(RecordFileError, match="max_new_tokens"):
        run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=tmp_path / "shard0" / "traces.jsonl",
                                max_new_tokens=4, limit=7, shard="0/2"))


SLOW_SHARD = ("import sys, time, specdraft.model.slot_engine as d\n"
              "step = d.SlotDecoder.step\n"
              "d.SlotDecoder.step = lambda self: (time.sleep(0.05), step(self))[1]\n"
              "from specdraft.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")


def test_shards_in_separate_processes_one_killed_and_resumed_merge_to_a_single_runs_traces(tiny, tmp_path):
    """Two `specdraft traces --shard i/2` processes side by side, shard 0 killed mid-run and resumed, then
    `specdraft merge-traces`: the merged file holds a single run's rows (ids, tokens, finish reasons) in the prompts
    file's order, its summary names the shards with their hashes, and the audit follows it back to them."""
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 16)
    shards = [tmp_path / f"shard{i}" / "traces.jsonl" for i in range(2)]

    def shard_args(i):
        return ["traces", "--target", str(tiny[0]), "--prompts", str(prompts), "--out", str(shards[i]),
                "--max-new-tokens", "6", "--batch-size", "2", "--device", "cpu", "--shard", f"{i}/2"]

    slowed = subprocess.Popen([sys.executable, "-c", SLOW_SHARD, *shard_args(0)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    other = subprocess.Popen([sys.executable, "-m", "specdraft.cli", *shard_args(1)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and slowed.poll() is None:
        if shards[0].is_file() and shards[0].read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.05)
    slowed.kill()
    slowed.wait()
    assert slowed.returncode == -9, "shard 0 ended before it could be killed"
    assert 2 <= shards[0].read_bytes().count(b"\n") < 8
    assert other.wait(timeout=120) == 0, other.stderr.read()[-2000:]

    merge = ["merge-traces", "--shards", str(shards[0]), "--shards", str(shards[1]),
             "--out", str(tmp_path / "merged" / "traces.jsonl")]
    with pytest.raises(RecordFileError, match=r"shard0/traces.summary.json: not a finished traces run .*resume"):
        run_merge_traces(MergeTracesConfig(shards=shards, out=tmp_path / "merged" / "traces.jsonl"))
    assert main(shard_args(0)) == 0  # the resume: the same command again
    assert main(merge) == 0
    merged = tmp_path / "merged" / "traces.jsonl"

    single = run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=tmp_path / "single" / "traces.jsonl",
                                     max_new_tokens=6, batch_size=2))
    order = {f"p{i}": i for i in range(16)}
    single_rows = sorted(_rows(single.out), key=lambda r: order[r["id"]])
    assert _rows(merged) == single_rows  # every field of every row, in the prompts file's order
    assert merged.read_text() == "".join(jsonl_line(r) + "\n" for r in single_rows)
    summary = json.loads((tmp_path / "merged" / "traces.summary.json").read_text())
    assert summary["stage"] == "merge-traces" and summary["status"] == "complete"
    assert [s["shard"] for s in summary["shards"]] == ["0/2", "1/2"]
    assert [s["sha256"] for s in summary["shards"]] == [sha256_file(f) for f in shards]
    assert summary["traces_sha256"] == sha256_file(merged) and summary["rows"] == 16
    for key in ("rows", "prompt_tokens", "completion_tokens", "finish_reasons", "resume_key", "target"):
        assert summary[key] == single.summary_data[key], key
    assert summary["traces_config"]["max_new_tokens"] == 6

    # the audit's traces link on the merged file: the shards check passes, and a changed shard fails it
    def audit(traces):
        ctx = AuditContext(AuditConfig(run_dir=str(tmp_path), prompts=str(prompts), traces=str(traces),
                                       greedy_check=0, serve_check=False))
        audit_traces(ctx)
        return {f.check: f for f in ctx.findings}

    found = audit(merged)
    for check in ("traces shards", "traces complete", "traces counts", "trace ids in prompts", "prompt ids",
                  "finish reasons"):
        assert found[check].status == "pass", (check, found[check].message)
    with open(shards[1], "a") as f:
        f.write("\n")  # the same rows, another file
    assert audit(merged)["traces shards"].status == "fail"


def test_merge_refuses_missing_overlapping_and_foreign_shards(tiny, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 5)

    def shard(name, spec, max_new_tokens=2):
        out = tmp_path / name / "traces.jsonl"
        run_traces(TracesConfig(target=str(tiny[0]), prompts=prompts, out=out, max_new_tokens=max_new_tokens,
                                shard=spec))
        return out
    a, b, c = shard("a", "0/2"), shard("b", "1/2"), shard("c", "0/2")
    out = tmp_path / "merged" / "traces.jsonl"
    with pytest.raises(RecordFileError, match=r"shard\(s\) 1/2 missing"):
        run_merge_traces(MergeTracesConfig(shards=[a], out=out))
    with pytest.raises(RecordFileError, match=rf"{c} and {a} are both shard 0/2"):
        run_merge_traces(MergeTracesConfig(shards=[a, b, c], out=out))
    d = shard("d", "1/2", max_new_tokens=3)
    with pytest.raises(RecordFileError, match=r"d/traces.summary.json: made with other settings .*max_new_tokens"):
        run_merge_traces(MergeTracesConfig(shards=[a, d], out=out))
    rows = b.read_text().splitlines()
    b.write_text("\n".join(rows[:-1]) + "\n")
    with pytest.raises(RecordFileError, match=rf"{b}: changed since its run finished"):
        run_merge_traces(MergeTracesConfig(shards=[a, b], out=out))
    assert not out.exists()


def test_repair_jsonl_keeps_complete_lines(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a"')
    assert repair_jsonl(f) == 4 and f.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    assert repair_jsonl(f) == 0
    f.write_bytes(b'{"a"')
    assert repair_jsonl(f) == 4 and f.read_bytes() == b""


# ------------------------------------------------------------------------------------------------ vllm

class FakeCompletion(SimpleNamespace):
    pass


class FakeLLM:
    """Shaped like vllm.LLM: generate(prompts=[{"prompt_token_ids": ...}], sampling_params) -> RequestOutputs."""

    def __init__(self, eos, **kwargs):
        self.kwargs, self.eos, self.calls = kwargs, eos, []

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        outs = []
        for req in prompts:
            ids = req["prompt_token_ids"]
            kind = len(ids) % 3
            if kind == 0:  # stopped at EOS, EOS in token_ids (what vLLM returns)
                comp = FakeCompletion(token_ids=[5, 6, self.eos], finish_reason="stop", stop_reason=None)
            elif kind == 1:  # stopped at EOS, EOS left out but named in stop_reason
                comp = FakeCompletion(token_ids=(7,), finish_reason="stop", stop_reason=self.eos)
            else:
                comp = FakeCompletion(token_ids=list(range(10, 10 + sampling_params.max_tokens)),
                                      finish_reason="length", stop_reason=None)
            outs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[comp]))
        return outs


def _fake_vllm(eos):
    made = {}

    def LLM(**kwargs):
        made["llm"] = FakeLLM(eos, **kwargs)
        return made["llm"]

    return SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: SimpleNamespace(**kw)), made


def test_vllm_backend_maps_requests_and_outputs(tiny, tmp_path):
    path, model, tok = tiny
    eos = model.generation_config.eos_token_id
    module, made = _fake_vllm(eos)
    backend = VLLMBackend(str(path), tensor_parallel_size=2, chunk=3, vllm_module=module)
    assert made["llm"].kwargs == {"model": str(path), "tokenizer": str(path), "dtype": "float32",
                                  "tensor_parallel_size": 2, "seed": 0}
    prompts = _write_prompts(tmp_path / "prompts.jsonl", 7, repeat_long=True)
    out = tmp_path / "traces.jsonl"
    run_traces(TracesConfig(target=str(path), prompts=prompts, out=out, max_new_tokens=4, backend="vllm",
                            vllm_chunk=3), backend=backend)
    calls = made["llm"].calls
    assert [len(reqs) for reqs, _ in calls] == [3, 3, 1]  # chunks of vllm_chunk prompts
    params = calls[0][1]
    assert (params.temperature, params.max_tokens, params.stop_token_ids) == (0.0, 4, [eos])
    ids = encode_prompts(tok, [r.text for r in read_prompts(prompts)])
    assert [req["prompt_token_ids"] for reqs, _ in calls for req in reqs] == ids
    for row in _rows(out):
        kind = len(row["prompt_ids"]) % 3
        expect = {0: ([5, 6, eos], "eos"), 1: ([7, eos], "eos"), 2: ([10, 11, 12, 13], "length")}[kind]
        assert (row["completion_ids"], row["finish_reason"]) == expect


def test_vllm_eos_set_joins_tokenizer_and_generation_config(tiny, tmp_path):
    """The generation config names one EOS and the tokenizer another: vLLM stops at both, and a stop on the
    tokenizer's EOS keeps that token as the last one (no second EOS appended)."""
    path, _, tok = tiny
    model_dir = tmp_path / "model"
    shutil.copytree(path, model_dir)
    tokenizer_eos, config_eos = tok.eos_token_id, tok.pad_token_id
    gen_config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**gen_config, "eos_token_id": config_eos}))
    module, made = _fake_vllm(tokenizer_eos)
    backend = VLLMBackend(str(model_dir), tensor_parallel_size=1, chunk=8, vllm_module=module)
    assert backend.eos_ids() == {tokenizer_eos, config_eos}
    (_, gen), = backend.generate([[3, 4, 5]], 4)  # FakeLLM: stopped at its EOS, token in the output
    assert (gen.tokens, gen.finish_reason) == ([5, 6, tokenizer_eos], "eos")
    assert made["llm"].calls[0][1].stop_token_ids == sorted({tokenizer_eos, config_eos})

    def stopped(token_ids, stop_reason):
        out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, finish_reason="stop",
                                                       stop_reason=stop_reason)])
        return vllm_generation(out, backend.eos_ids(), tokenizer_eos).tokens

    assert stopped([5, tokenizer_eos], None) == [5, tokenizer_eos]
    assert stopped([5, config_eos], config_eos) == [5, config_eos]
    assert stopped([5], config_eos) == [5, config_eos]  # a stop token id left out of the output
    assert stopped([5], None) == [5, tokenizer_eos]  # vLLM's own EOS check, token left out
    with pytest.raises(RuntimeError, match="without an EOS"):
        stopped([5], "a stop string")


def test_vllm_generation_rejects_aborted():
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], finish_reason="abort")])
    with pytest.raises(RuntimeError, match="abort"):
        vllm_generation(out, {2})


def test_a_backend_without_top_logprobs_is_refused_before_decoding(tiny, tmp_path):
    """--top-logprobs with a backend that cannot return them fails before any prompt is decoded, rather than
    writing rows without the distribution train --kd-stored reads."""
    module, made = _fake_vllm(tiny[1].generation_config.eos_token_id)
    backend = VLLMBackend(str(tiny[0]), tensor_parallel_size=1, chunk=8, vllm_module=module)
    assert not backend.supports_top_logprobs
    out = tmp_path / "traces.jsonl"
    cfg = TracesConfig(target=str(tiny[0]), prompts=_write_prompts(tmp_path / "prompts.jsonl", 2), out=out,
                       max_new_tokens=4, top_logprobs=2)
    with pytest.raises(ValueError, match="backend 'vllm' cannot return them"):
        run_traces(cfg, backend=backend)
    assert made["llm"].calls == [] and out.read_text() == ""
    with pytest.raises(ValueError, match="hf backend only"):
        next(backend.generate([[3, 4]], 4, top_logprobs=2))


def test_vllm_backend_without_vllm_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ValueError, match="needs the vllm package"):
        VLLMBackend(str(tiny[0]), tensor_parallel_size=1, chunk=8)


# ------------------------------------------------------------------------------------------ validation

def test_evaluation_points():
    assert evaluation_points(list(range(40)), 16) == [0, 16]
    assert evaluation_points(list(range(32)), 16) == [0, 16]
    assert evaluation_points(list(range(15)), 16) == []


def test_validation_points_follow_the_greedy_continuation(tiny, tmp_path):
    path, model, tok = tiny
    mt = tmp_path / "mt.jsonl"
    with open(mt, "w") as f:
        for q, cat in [(81, "writing"), (82, "math"), (83, "coding")]:
            f.write(json.dumps({"question_id": q, "category": cat, "turns": [TEXTS[q % 8], "again"]}) + "\n")
    out = tmp_path / "validation.jsonl"
    cfg = ValidationConfig(target=str(path), prompts=mt, out=out, max_new_tokens=20, num_draft=4, batch_size=2)
    run_validation(cfg)
    rows = _rows(out)
    ids = dict(zip(["81", "82", "83"], encode_prompts(tok, [TEXTS[q % 8] for q in (81, 82, 83)])))
    eos = model.generation_config.eos_token_id
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    for qid, points in by_id.items():
        cont = greedy_decode(model, [ids[qid]], 20, eos_ids={eos})[0].tokens
        assert [p["offset"] for p in points] == evaluation_points(cont, 4)
        for p in points:
            assert p["context_ids"] == ids[qid] + cont[:p["offset"]]
            assert p["target_ids"] == cont[p["offset"]:p["offset"] + 4]
            assert p["category"] == {"81": "writing", "82": "math", "83": "coding"}[qid]
    p = rows[-1]
    assert naive_greedy(model, p["context_ids"], 4, stop_at_eos=False).tokens[:len(p["target_ids"])] == p["target_ids"]
    summary = json.loads((tmp_path / "validation.summary.json").read_text())
    assert summary["points"] == len(rows) and summary["eval"]["sha256"]
    # Resume: cut the file inside the last prompt's points; that prompt is redone, nothing duplicated.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][:5])
    run_validation(cfg)
    again = _rows(out)
    assert sorted((r["id"], r["offset"]) for r in again) == sorted((r["id"], r["offset"]) for r in rows)


class _ShortOrLongBackend(TraceBackend):
    """A fake backend: 3 tokens (too few for a point) for the prompts in ``short``, 8 for the others."""

    name = "fake"

    def __init__(self, short: set[tuple[int, ...]], summary: Path):
        self.short, self.summary, self.decoded = short, summary, []

    def generate(self, prompts, max_new_tokens, top_logprobs=0):
        for i, p in enumerate(prompts):
            self.decoded.append(tuple(p))
            n = 3 if tuple(p) in self.short else 8
            yield i, Generation(list(range(100, 100 + n)), "eos")
        # Before the run ends, the summary already names the point-less prompts (a kill keeps them).
        assert json.loads(self.summary.read_text())["ids_without_points"] == ["1"]


def test_validation_remembers_prompts_without_points(tiny, tmp_path):
    path, _, tok = tiny
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": TEXTS[i]}) + "\n" for i in range(3)))
    ids = encode_prompts(tok, TEXTS[:3])
    out = tmp_path / "validation.jsonl"
    cfg = ValidationConfig(target=str(path), prompts=prompts, out=out, max_new_tokens=8, num_draft=4)
    first = _ShortOrLongBackend({tuple(ids[1])}, tmp_path / "validation.summary.json")
    res = run_validation(cfg, backend=first)
    assert len(first.decoded) == 3 and sorted({r["id"] for r in _rows(out)}) == ["0", "2"]
    assert res.summary_data["ids_without_points"] == ["1"] and res.summary_data["prompts_without_points"] == 1
    again = _ShortOrLongBackend(set(), tmp_path / "validation.summary.json")
    res = run_validation(cfg, backend=again)
    assert again.decoded == [] and res.new_prompts == 0  # prompt 1 is not decoded again
    assert res.summary_data["ids_without_points"] == ["1"]


def test_the_stage_closes_the_backend_it_builds_and_not_one_passed_in(tiny, tmp_path, monkeypatch):
    path, _, tok = tiny
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": TEXTS[i]}) + "\n" for i in range(3)))
    closed = []

    class Closing(_ShortOrLongBackend):
        def close(self):
            closed.append(self)

    summary = tmp_path / "built" / "validation.summary.json"
    built = Closing({tuple(encode_prompts(tok, TEXTS[1:2])[0])}, summary)
    monkeypatch.setattr("specdraft.stages.traces.make_backend", lambda cfg: built)
    run_validation(ValidationConfig(target=str(path), prompts=prompts, out=summary.parent / "validation.jsonl",
                                    max_new_tokens=8, num_draft=4))
    assert closed == [built] and len(built.decoded) == 3
    summary = tmp_path / "given" / "validation.summary.json"
    given = Closing({tuple(encode_prompts(tok, TEXTS[1:2])[0])}, summary)
    res = run_validation(ValidationConfig(target=str(path), prompts=prompts, out=summary.parent / "validation.jsonl",
                                          max_new_tokens=8, num_draft=4), backend=given)
    assert closed == [built] and len(given.decoded) == 3
    assert res.summary_data["this_run"]["backend"] == "fake"  # TraceBackend.info's default record
