"""`specdraft conversations` on a tiny random target: rows whose context holds the target's own first answer (a
follow-up turn after it, or it as a passage), in the chat template, answered greedily by the target; resumable,
deterministic, decontaminated, and read by `specdraft train` as traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.core.io import RecordFileError
from specdraft.core.records import read_traces
from specdraft.data.corpus import heldout_path
from specdraft.data.followups import load_requests
from specdraft.data.readers import read_eval_prompts
from specdraft.data.text import ngram_overlap
from specdraft.model.simple_decode import naive_greedy
from specdraft.model.specs import load_model, load_tokenizer
from specdraft.model.trace_backend import HFBackend, TraceBackend
from specdraft.stages.conversations import ConversationsConfig, run_conversations
from specdraft.stages.traces import TracesConfig, run_traces

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "data"
MT_BENCH = FIX / "mt_bench.jsonl"
# a held-out prompt long enough to hold a 13-word sequence
HELDOUT_LONG = next(p for p in (json.loads(line)["prompt"] for line in heldout_path().read_text().splitlines())
                    if len(p.split()) >= 20)
MT_BENCH_TURN2 = read_eval_prompts(MT_BENCH)[1]  # question 81's second turn


def _prompts() -> list[dict]:
    rows = [{"id": f"p{i:02d}", "source": "chat" if i % 2 else "code",
             "prompt": f"Tell me something useful about topic number {i}, in a few sentences."} for i in range(10)]
    rows[1]["followup"] = "Why does that matter for a beginner?"  # a chat's own second turn
    rows[3]["followup"] = MT_BENCH_TURN2  # an evaluation turn: its row must never be made
    rows[5]["prompt"] = f"Please help. {HELDOUT_LONG}"  # a held-out prompt inside a training prompt
    return rows


@pytest.fixture(scope="module")
def first_turns(tiny_qwen3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("conversations")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _prompts()))
    traces = root / "traces.jsonl"
    run_traces(TracesConfig(target=str(tiny_qwen3_dir), prompts=prompts, out=traces, max_new_tokens=24,
                            device="cpu", batch_size=4))
    return prompts, traces


def _config(tiny_qwen3_dir, first_turns, out: Path, **kw) -> ConversationsConfig:
    prompts, traces = first_turns
    settings = dict(target=str(tiny_qwen3_dir), prompts=prompts, first_turns=traces, out=out, followups=8,
                    passages=3, max_new_tokens=10, device="cpu", batch_size=3, min_passage_words=1,
                    eval_set=[str(MT_BENCH)])
    return ConversationsConfig(**{**settings, **kw})


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def made(tiny_qwen3_dir, first_turns, tmp_path_factory):
    out = tmp_path_factory.mktemp("made") / "rows.jsonl"
    result = run_conversations(_config(tiny_qwen3_dir, first_turns, out))
    return out, result


def test_followup_rows_are_the_conversation_with_the_targets_own_answer(made, first_turns, tiny_qwen3_dir):
    out, result = made
    tokenizer = load_tokenizer(str(tiny_qwen3_dir))
    prompts = {r["id"]: r for r in _rows(first_turns[0])}
    answers = {r["id"]: r["completion_ids"] for r in _rows(first_turns[1])}
    followups = {r.text: r.name for r in load_requests()[0]}
    rows = [r for r in _rows(out) if r.get("kind") == "followup"]
    assert len(rows) == 8 and result.summary_data["kinds"]["followup"] == 8  # every clean one
    assert "p01/followup" in {r["id"] for r in rows}  # own second turns go first
    for row in rows:
        first = prompts[row["first_turn"]]
        answer = tokenizer.decode(answers[first["id"]], skip_special_tokens=True).strip()
        assert answer  # the tiny target's own words, whatever they are
        asked = first.get("followup") or next(text for text, name in followups.items() if name == row["request"])
        assert row["request"] == ("conversation" if first.get("followup") else followups[asked])
        messages = [{"role": "user", "content": first["prompt"]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": asked}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                                 tokenize=False)
        assert row["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # the completion is the target's greedy answer to that context
    target = load_model(str(tiny_qwen3_dir), dtype=torch.float32)
    for row in rows[:3]:
        greedy = naive_greedy(target, row["prompt_ids"], 10).tokens
        assert row["completion_ids"] == greedy


def test_passage_rows_carry_a_first_answer_in_a_packaged_request(made, first_turns, tiny_qwen3_dir):
    out, _ = made
    tokenizer = load_tokenizer(str(tiny_qwen3_dir))
    answers = {r["id"]: r["completion_ids"] for r in _rows(first_turns[1])}
    requests = {r.name: r for r in load_requests()[1]}
    rows = [r for r in _rows(out) if r.get("kind") == "passage"]
    assert len(rows) == 3
    for row in rows:
        passage = tokenizer.decode(answers[row["first_turn"]], skip_special_tokens=True).strip()
        text = requests[row["request"]].with_passage(passage)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 enable_thinking=False, tokenize=False)
        assert row["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_no_row_holds_held_out_or_mt_bench_text(made, tiny_qwen3_dir):
    out, result = made
    tokenizer = load_tokenizer(str(tiny_qwen3_dir))
    rows = _rows(out)
    followups_of = {r["first_turn"] for r in rows if r.get("kind") == "followup"}
    assert "p03" not in followups_of  # its own second turn is MT-bench's
    assert "p05" not in followups_of  # its prompt holds a held-out prompt
    assert result.summary_data["not_made"]["contaminated"] == 2
    texts = [tokenizer.decode(r["prompt_ids"] + r["completion_ids"]) for r in rows if "kind" in r]
    evals = read_eval_prompts(heldout_path()) + read_eval_prompts(MT_BENCH)
    assert ngram_overlap(texts, evals, 13) == []
    # the first-turn rows are copied in as they are (the prompts stage decontaminates those)
    assert len([r for r in rows if "kind" not in r]) == 10 == result.summary_data["first_turns_copied"]


def test_train_reads_the_rows_as_traces(made):
    out, _ = made
    examples = read_traces(out, 1024)
    assert len(examples) == 21
    assert all(r["finish_reason"] in ("eos", "length") and r["completion_ids"] for r in _rows(out))
    long = next(e for e in examples if e.id.endswith("/followup"))
    assert long.prompt_len > 24  # the context holds the first answer


class _Interrupted(TraceBackend):
    """The hf backend's rows, until ``stop_after`` have been yielded: then the run dies, as a killed one does."""

    name = "hf"

    def __init__(self, inner: HFBackend, stop_after: int):
        self.inner, self.stop_after = inner, stop_after

    def generate(self, prompts, max_new_tokens, top_logprobs=0):
        for n, (i, gen) in enumerate(self.inner.generate(prompts, max_new_tokens)):
            if n == self.stop_after:
                raise KeyboardInterrupt
            yield i, gen


def test_resume_after_a_kill_neither_loses_nor_duplicates(made, tiny_qwen3_dir, first_turns, tmp_path):
    out = tmp_path / "rows.jsonl"
    cfg = _config(tiny_qwen3_dir, first_turns, out)
    with HFBackend(str(tiny_qwen3_dir), "cpu", 3) as inner:
        with pytest.raises(KeyboardInterrupt):
            run_conversations(cfg, backend=_Interrupted(inner, 4))
    partial = _rows(out)
    assert 10 < len(partial) < 21  # the first turns and some rows made it
    with open(out, "a") as f:
        f.write('{"id": "torn')  # a write cut half-way
    again = run_conversations(cfg)
    rows = _rows(out)
    assert len(rows) == 21 == again.rows and len({r["id"] for r in rows}) == 21
    assert again.new_prompts == 11 - (len(partial) - 10)  # only what was missing was decoded
    by_id = {r["id"]: r for r in _rows(made[0])}
    assert {r["id"]: r for r in rows} == by_id  # the rows an uninterrupted run writes


def test_deterministic_and_a_changed_plan_is_refused(made, tiny_qwen3_dir, first_turns, tmp_path):
    out = tmp_path / "again.jsonl"
    run_conversations(_config(tiny_qwen3_dir, first_turns, out, batch_size=5))
    assert sorted(out.read_text().splitlines()) == sorted(made[0].read_text().splitlines())
    with pytest.raises(RecordFileError, match="plan_sha256"):
        run_conversations(_config(tiny_qwen3_dir, first_turns, out, seed=1))
    other = run_conversations(_config(tiny_qwen3_dir, first_turns, tmp_path / "seed1.jsonl", seed=1))
    assert other.summary_data["plan_sha256"] != json.loads(made[1].summary.read_text())["plan_sha256"]


def test_first_turns_from_another_prompts_file_are_refused(tiny_qwen3_dir, first_turns, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text(first_turns[0].read_text() + json.dumps({"id": "x", "source": "s", "prompt": "p"}) + "\n")
    with pytest.raises(RecordFileError, match="another prompts file"):
        run_conversations(_config(tiny_qwen3_dir, first_turns, tmp_path / "o.jsonl", prompts=other))
    with pytest.raises(ValueError, match="at least one row"):
        _config(tiny_qwen3_dir, first_turns, tmp_path / "o.jsonl", followups=0, passages=0)

