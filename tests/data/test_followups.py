"""A chat's second user turn (what `specdraft conversations` asks after the target's first answer): read from the
record, carried through the prompts stage, and stripped there when it shares an n-gram with an evaluation set; the
packaged follow-ups and passage requests, picked by a seeded hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from specdraft.core.io import RecordFileError
from specdraft.core.records import read_prompts
from specdraft.data.corpus import heldout_path
from specdraft.data.followups import PASSAGE_SLOT, load_requests, pick
from specdraft.data.readers import get_followup_reader, read_eval_prompts
from specdraft.data.text import ngram_overlap
from specdraft.stages.prompts import PromptsConfig, build_prompts

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def test_followup_reader_takes_the_users_turn_after_the_first_answer():
    chat = get_followup_reader("chat")
    turns = [{"from": "gpt", "value": "earlier answer"}, {"from": "human", "value": "q"},
             {"from": "gpt", "value": "a"}, {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
             {"from": "human", "value": "q3"}]
    assert chat({"conversations": turns}) == "q2"  # after the first user turn's answer, not the leading gpt turn
    assert chat({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]}) is None
    assert chat({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) is None
    assert chat({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                              {"role": "user", "content": "  "}]}) is None
    assert chat({"conversations": "not a list"}) is None  # odd records: no follow-up, never an error
    assert get_followup_reader("alpaca")({"instruction": "i", "output": "o"}) is None


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prompts_stage_carries_followups_and_strips_contaminated_ones(tmp_path, tiny_qwen3_dir):
    leak = read_eval_prompts(FIX / "mt_bench.jsonl")[0]  # MT-bench turn 1 of question 81
    chats = [
        [("human", "How do I keep basil alive indoors?"), ("gpt", "Water it."), ("human", "And in winter?")],
        [("human", "Plan a weekend in Lisbon for me."), ("gpt", "Sure."), ("human", f"Also: {leak}")],
        [("human", "What is a closure in Python?"), ("gpt", "A function.")],
    ]
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text("".join(json.dumps({"conversations": [{"from": r, "value": v} for r, v in c]}) + "\n"
                              for c in chats))
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({
        "schema_version": 1, "name": "t", "uses_eval_splits": False, "eval_examples_used_as_targets": False,
        "notes": "", "corpora": [{"name": "chats", "kind": "local_file", "path": str(corpus), "sha256": _sha(corpus),
                                  "format": "jsonl", "reader": "chat", "license": "MIT"}]}))
    res = build_prompts(PromptsConfig(manifest=str(manifest), out=str(tmp_path / "o" / "prompts.jsonl"),
                                      tokenizer=str(tiny_qwen3_dir), eval_set=[str(FIX / "mt_bench.jsonl")]))
    rows = {r["prompt"]: r for r in map(json.loads, res.out.read_text().splitlines())}
    assert set(rows) == {c[0][1] for c in chats}
    assert rows["How do I keep basil alive indoors?"]["followup"] == "And in winter?"
    assert "followup" not in rows["Plan a weekend in Lisbon for me."]  # the prompt is clean and stays
    assert "followup" not in rows["What is a closure in Python?"]
    stats = json.loads(res.stats_path.read_text())
    assert stats["corpora"]["chats"]["with_followup"] == 1 and stats["corpora"]["chats"]["followup_contaminated"] == 1
    assert stats["contamination"]["followups_removed"] == 1
    records = {r.text: r for r in read_prompts(res.out)}
    assert records["How do I keep basil alive indoors?"].followup == "And in winter?"
    assert records["What is a closure in Python?"].followup is None


def test_read_prompts_refuses_an_empty_followup(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "source": "s", "prompt": "hi", "followup": ""}) + "\n")
    with pytest.raises(RecordFileError, match="followup"):
        read_prompts(path)


def test_packaged_requests_are_clean_and_picked_by_a_seeded_hash():
    followups, passages = load_requests()
    assert len(followups) >= 8 and len(passages) >= 5
    assert all(r.text.count(PASSAGE_SLOT) == 1 for r in passages)
    assert {"translate_french", "summarise"} <= {r.name for r in passages}
    wrapped = passages[0].with_passage("some text")
    assert PASSAGE_SLOT not in wrapped and "some text" in wrapped
    # never an evaluation set's text (the packaged held-out set and the MT-bench fixture)
    evals = read_eval_prompts(heldout_path()) + read_eval_prompts(FIX / "mt_bench.jsonl")
    assert ngram_overlap([r.text for r in followups + passages], evals, 13) == []
    picks = [pick(followups, 0, f"row{i}").name for i in range(40)]
    assert picks == [pick(followups, 0, f"row{i}").name for i in range(40)]  # deterministic
    assert len(set(picks)) > 3  # and spread over the list
    assert picks != [pick(followups, 1, f"row{i}").name for i in range(40)]  # the seed moves it
