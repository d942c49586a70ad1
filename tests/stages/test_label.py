"""`specdraft label`: teacher-forced labels of reference answers, checked against an independent forward pass."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.core.io import RecordFileError
from specdraft.core.records import read_answers, read_traces
from specdraft.model.batching import collate
from specdraft.model.chat import encode_prompts
from specdraft.stages.label import LabelConfig, answer_ids, label_batch, run_label
from specdraft.stages.train import TrainConfig, run_train


def _prompts(path, n=12):
    rows = []
    for i in range(n):
        row = {"id": f"p{i}", "source": "test", "prompt": f"question number {i} about bees and hives"}
        if i % 4 != 3:  # every fourth row has no reference answer
            row["response"] = " ".join(["the answer is that bees decide together"] * (1 + i % 3)) + f" {i}"
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_labels_are_the_targets_argmax_at_every_answer_position(tiny_qwen3_dir, tmp_path):
    prompts = _prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "labels" / "labels.jsonl"
    res = run_label(LabelConfig(target=str(tiny_qwen3_dir), prompts=str(prompts), out=str(out), batch_tokens=96,
                                min_answer_tokens=1))
    rows = _rows(out)
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(12) if i % 4 != 3)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    source = {f"p{i}": r for i, r in enumerate(map(json.loads, prompts.read_text().splitlines()))}
    for r in rows:
        prompt_ids = encode_prompts(tok, [source[r["id"]]["prompt"]])[0]
        assert r["prompt_ids"] == prompt_ids
        assert r["completion_ids"] == answer_ids(tok, prompt_ids, source[r["id"]]["response"], 1024)
        assert r["completion_ids"][-1] == tok.eos_token_id
        with torch.no_grad():  # one unpadded sequence, full logits: independent of the batched path
            logits = model(torch.tensor([r["prompt_ids"] + r["completion_ids"]])).logits[0]
        p = len(r["prompt_ids"])
        assert r["target_ids"] == logits[p - 1:-1].argmax(-1).tolist()
    summary = json.loads((tmp_path / "labels" / "labels.summary.json").read_text())
    assert summary["status"] == "complete" and summary["rows"] == len(rows) == res.rows
    assert summary["label_tokens"] == sum(len(r["target_ids"]) for r in rows)
    assert summary["prompts"]["with_response"] == 9 and len(summary["prompts"]["sha256"]) == 64


def test_label_batch_equals_one_row_at_a_time(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    seqs = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
    plens = [3, 1, 6]
    with torch.no_grad():
        batched = label_batch(model, seqs, plens, pad_id=0)
        single = [label_batch(model, [s], [p], pad_id=0)[0] for s, p in zip(seqs, plens)]
    assert batched == single
    assert [len(b) for b in batched] == [4, 2, 4]


def test_label_resumes_without_duplicates_and_refuses_another_target(tiny_qwen3_dir, tiny_llama_dir, tmp_path):
    prompts = _prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "labels.jsonl"
    cfg = dict(target=str(tiny_qwen3_dir), prompts=str(prompts), out=str(out), min_answer_tokens=1)
    run_label(LabelConfig(**cfg, limit=4))
    first = _rows(out)
    with open(out, "a") as f:  # a kill in the middle of a write
        f.write('{"id": "p9", "prompt_ids": [1, 2')
    res = run_label(LabelConfig(**cfg))
    rows = _rows(out)
    assert rows[:len(first)] == first and len(rows) == 9 == len({r["id"] for r in rows})
    assert res.new_prompts == 5
    with pytest.raises(RecordFileError, match="different settings"):
        run_label(LabelConfig(**{**cfg, "target": str(tiny_llama_dir)}))


def test_read_answers_needs_ids_and_prompts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x", "response": "y"}\n{"id": "a", "prompt": "z"}\n')
    with pytest.raises(RecordFileError, match="duplicate id"):
        read_answers(bad)
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(RecordFileError, match="'id' and 'prompt'"):
        read_answers(bad)


def test_label_without_any_reference_answer_is_refused(tiny_qwen3_dir, tmp_path):
    for text in ("", '{"id": "a", "prompt": "x"}\n'):  # empty, or no row with a response
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(text)
        with pytest.raises(RecordFileError, match="no row with a reference answer"):
            run_label(LabelConfig(target=str(tiny_qwen3_dir), prompts=str(prompts), out=str(tmp_path / "labels.jsonl")))
        assert not (tmp_path / "labels.jsonl").exists()


def test_train_uses_the_target_ids_not_the_reference_tokens(tiny_qwen3_dir, tmp_path):
    rows = [{"id": "a", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6], "target_ids": [7, 8, 9]}]
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    (ex,) = read_traces(path, 1024)
    batch = collate([ex], pad_id=0, device="cpu")
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 7, 8, 9]]
    path.write_text(json.dumps({**rows[0], "target_ids": [7]}) + "\n")
    with pytest.raises(ValueError, match="1 target_ids for 3 completion ids"):
        read_traces(path, 1024)


def test_train_with_labels_records_them_and_keeps_them_out_of_the_held_out_set(tiny_qwen3_dir, tmp_path):
    from specdraft.model.decode import greedy_decode
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    prompts = [[3 + i, 40 + i, 90 + i, 7] for i in range(8)]
    traces = tmp_path / "traces.jsonl"
    with open(traces, "w") as f:
        for i, (p, g) in enumerate(zip(prompts, greedy_decode(model, prompts, 12, stop_at_eos=False))):
            f.write(json.dumps({"id": f"t{i}", "prompt_ids": p, "completion_ids": g.tokens,
                                "finish_reason": g.finish_reason}) + "\n")
    labels = tmp_path / "lab" / "labels.jsonl"
    run_label(LabelConfig(target=str(tiny_qwen3_dir), prompts=str(_prompts(tmp_path / "prompts.jsonl")),
                          out=str(labels), min_answer_tokens=1))
    cfg = TrainConfig(traces=str(traces), labels=str(labels), init=f"truncate:{tiny_qwen3_dir}:1",
                      out=str(tmp_path / "ckpt"), target=str(tiny_qwen3_dir), epochs=1, batch_tokens=256,
                      eval_every=2, heldout_fraction=0.3, warmup_steps=1)
    meta = run_train(cfg)
    assert meta["labels"]["count"] == 9 and meta["labels"]["tokens"] == sum(
        len(r["target_ids"]) for r in _rows(labels))
    assert meta["labels"]["summary_sha256"] is not None
    assert meta["traces"]["train"] == meta["traces"]["count"] - meta["traces"]["heldout"]
    with pytest.raises(ValueError, match="held-out examples must be greedy traces"):
        run_train(TrainConfig(**{**cfg.model_dump(), "heldout_traces": str(labels), "out": str(tmp_path / "c2")}))


def test_on_policy_labels_are_the_drafts_continuations_with_the_targets_argmax(tiny_qwen3_dir, tmp_path):
    """--answers-from: every prompt (with a response or not) continued by the draft, labelled by the target."""
    from specdraft.model.simple_decode import naive_greedy
    from specdraft.model.tiny import build_tiny_model
    draft_dir = build_tiny_model(tmp_path / "draft", "qwen3", layers=1, seed=7)
    prompts = _prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "labels" / "labels.jsonl"
    run_label(LabelConfig(target=str(tiny_qwen3_dir), prompts=str(prompts), out=str(out), answers_from=str(draft_dir),
                          max_new_tokens=6, min_answer_tokens=1, device="cpu"))
    rows = _rows(out)
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(12))
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    for r in rows:
        assert r["completion_ids"] == naive_greedy(draft, r["prompt_ids"], 6).tokens
        with torch.no_grad():
            logits = target(torch.tensor([r["prompt_ids"] + r["completion_ids"]])).logits[0]
        assert r["target_ids"] == logits[len(r["prompt_ids"]) - 1:-1].argmax(-1).tolist()
    assert any(r["target_ids"] != r["completion_ids"] for r in rows)  # a random draft is not the target
    # rows of another draft (or length) are not mixed in on a rerun
    other = build_tiny_model(tmp_path / "other", "qwen3", layers=1, seed=8)
    with pytest.raises(ValueError, match="no draft weights there"):
        run_label(LabelConfig(target=str(tiny_qwen3_dir), prompts=str(prompts), out=str(tmp_path / "x.jsonl"),
                              answers_from=str(tmp_path), min_answer_tokens=1, device="cpu"))
    with pytest.raises(ValueError, match="different settings .'answers_from'"):
        run_label(LabelConfig(target=str(tiny_qwen3_dir), prompts=str(prompts), out=str(out),
                              answers_from=str(other), max_new_tokens=6, min_answer_tokens=1, device="cpu"))
