"""MT-bench both turns as evaluation points (tiny random target, a hand-written MT-bench-like file): turn 1 as
`specdraft validation` makes it, turn 2 in the conversation holding the target's own first answer, labels the
target's greedy tokens, decoded once."""

import json

import pytest
import torch

from specdraft.core.records import load_validation
from specdraft.data.mt_bench import read_mt_bench
from specdraft.data.readers import read_eval_prompts
from specdraft.drafting.mt_bench import continuation_points, second_turn_context, write_mt_bench_points
from specdraft.model.simple_decode import naive_greedy
from specdraft.model.specs import load_model, load_tokenizer
from specdraft.model.trace_backend import HFBackend
from specdraft.stages.traces import TracesConfig, ValidationConfig, run_traces, run_validation

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short story about a robot.",
                                                         "Rewrite your previous response in one sentence."]},
    {"question_id": 111, "category": "math", "turns": ["What is 12 times 7?", "Now explain the answer."]},
    {"question_id": 121, "category": "coding", "turns": ["Write a Python function that adds two numbers.",
                                                         "Translate your function into French comments."]},
]


def test_continuation_points_are_the_validation_stages():
    rows = continuation_points("q", "c", [1, 2], list(range(10, 50)), 16, 36)
    assert [r["offset"] for r in rows] == [0, 16]  # 36 tokens kept: two whole points
    assert rows[1]["context_ids"] == [1, 2] + list(range(10, 26)) and rows[1]["target_ids"] == list(range(26, 42))


@pytest.fixture(scope="module")
def built(tiny_qwen3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mt_bench")
    questions_path = root / "questions.jsonl"
    questions_path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    questions = read_mt_bench(questions_path)
    answers = root / "answers.jsonl"
    run_traces(TracesConfig(target=str(tiny_qwen3_dir), prompts=questions_path, out=answers, max_new_tokens=40,
                            device="cpu", batch_size=4))
    out = root / "validation.jsonl"
    built = []

    def backend():
        built.append(1)
        return HFBackend(str(tiny_qwen3_dir), "cpu", 4)
    summary = write_mt_bench_points(out, questions, questions_path, answers, str(tiny_qwen3_dir), backend, 16, 32)
    return {"root": root, "questions": questions, "questions_path": questions_path, "answers": answers, "out": out,
            "summary": summary, "built": built}


def test_turn_two_is_asked_after_the_targets_own_first_answer(built, tiny_qwen3_dir):
    tokenizer = load_tokenizer(str(tiny_qwen3_dir))
    answers = {json.loads(line)["id"]: json.loads(line) for line in built["answers"].read_text().splitlines()}
    points = load_validation(built["out"])
    by_turn = {t: [p for p in points if p.category.startswith(f"turn{t}/")] for t in (1, 2)}
    assert by_turn[1] and by_turn[2] and len(points) == built["summary"]["points"]
    for q in built["questions"]:
        first = [p for p in by_turn[2] if p.id == f"{q.id}-turn2" and p.offset == 0]
        assert len(first) == 1 and first[0].category == f"turn2/{q.category}"
        context = first[0].context_ids
        assert context == second_turn_context(tokenizer, q, answers[q.id]["completion_ids"])
        text = tokenizer.decode(context)
        answer = tokenizer.decode(answers[q.id]["completion_ids"], skip_special_tokens=True)
        assert answer and answer in text  # the target's own first answer, whole
        assert text.index(q.turns[0]) < text.index(answer) < text.index(q.turns[1])
    # labels: the target's greedy tokens after each context
    target = load_model(str(tiny_qwen3_dir), dtype=torch.float32)
    for p in by_turn[2][:3]:
        assert p.target_ids == naive_greedy(target, p.context_ids, 16, stop_at_eos=False).tokens
    summary = built["summary"]
    assert summary["categories"]["turn2/math"] == {"turn": 2, "category": "math",
                                                   "points": sum(p.category == "turn2/math" for p in points)}
    assert summary["key"]["answers_sha256"] and summary["answers_summary_sha256"]


def test_turn_one_points_are_what_the_validation_stage_writes(built, tiny_qwen3_dir):
    validation = built["root"] / "turn1.jsonl"
    run_validation(ValidationConfig(target=str(tiny_qwen3_dir), prompts=built["questions_path"], out=validation,
                                    max_new_tokens=32, device="cpu", batch_size=4))
    ours = [(p.id.removesuffix("-turn1"), p.offset, p.context_ids, p.target_ids)
            for p in load_validation(built["out"]) if p.category.startswith("turn1/")]
    theirs = [(p.id, p.offset, p.context_ids, p.target_ids) for p in load_validation(validation)]
    assert sorted(ours) == sorted(theirs)


def test_a_rerun_decodes_nothing_and_no_turn_escapes_decontamination(built, tiny_qwen3_dir):
    def no_backend():
        raise AssertionError("the points are there already: nothing to decode")
    before = built["out"].read_bytes()
    again = write_mt_bench_points(built["out"], built["questions"], built["questions_path"], built["answers"],
                                  str(tiny_qwen3_dir), no_backend, 16, 32)
    assert again == built["summary"] and built["out"].read_bytes() == before and built["built"] == [1]
    # the demo hands the MT-bench file to the prompts stage's contamination check: it reads every turn
    prompts = read_eval_prompts(built["questions_path"])
    assert all(turn in prompts for q in QUESTIONS for turn in q["turns"])
