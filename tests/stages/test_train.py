import argparse
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import specdraft.stages.train as train_stage
from specdraft.core.config import add_config_arguments, config_from_args
from specdraft.core.io import sha256_file
from specdraft.core.records import Example, read_traces
from specdraft.drafting.metrics import accepted_length
from specdraft.drafting.simulated import simulated_acceptance
from specdraft.model.batching import collate, scored_positions
from specdraft.model.decode import greedy_decode
from specdraft.model.distill import distill_loss, heldout_loss, make_batches, stored_kd_loss
from specdraft.model.loader import load_packed_model
from specdraft.model.tiny import build_tiny_model
from specdraft.model.truncate import parse_truncate_spec, truncate_layers
from specdraft.quant import q4g
from specdraft.quant.qat import enable_qat
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.train import TrainConfig, run_train, split_heldout


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("target"), "llama", layers=4, seed=3)


@pytest.fixture(scope="module")
def tiny_traces(tmp_path_factory, tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 20))] for _ in range(40)]
    gens = greedy_decode(model, prompts, 40, stop_at_eos=False)
    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    with open(path, "w") as f:
        for i, (p, g) in enumerate(zip(prompts, gens)):
            f.write(json.dumps({"id": f"t{i}", "source": "test", "prompt_ids": p,
                                "completion_ids": g.tokens, "finish_reason": g.finish_reason}) + "\n")
    return path


def _cfg(traces, model_dir, out, **kw):
    """A short run on the tiny target; the draft is its first 2 layers."""
    base = dict(traces=str(traces), init=f"truncate:{model_dir}:2", out=str(out), target=str(model_dir),
                epochs=2, lr=3e-3, warmup_steps=2, batch_tokens=256, eval_every=4, heldout_fraction=0.2,
                seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_parse_truncate_spec():
    assert parse_truncate_spec("truncate:embedded:smollm2-135m-instruct:4") == ("embedded:smollm2-135m-instruct", 4)
    assert parse_truncate_spec("truncate:/x/y:0,2,5") == ("/x/y", [0, 2, 5])
    assert parse_truncate_spec("/plain/dir") is None
    for bad in ("truncate:4", "truncate:/x/y:two", "truncate:/x/y:1,,2"):
        with pytest.raises(ValueError, match="--init .*expected truncate:TARGET_SPEC:N"):
            parse_truncate_spec(bad)


@pytest.mark.parametrize("name", ["train.default.json", "train.labels.json", "train.qat.json", "train.qwen3-8b.json"])
def test_shipped_train_configs_load_through_the_cli(name):
    """The README runs them as `specdraft train --config FILE` (plus flags): every field valid, and the GPU
    reference's file complete on its own (it names traces, init and out)."""
    config_file = Path(__file__).resolve().parents[2] / "configs" / name
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TrainConfig)  # the options `specdraft train` has
    flags = [] if name == "train.qwen3-8b.json" else ["--traces", "t.jsonl", "--out", "o", "--init", "x"]
    config = config_from_args(TrainConfig, parser.parse_args(flags), str(config_file))
    assert config.to_json_dict()["out"] == json.loads(config_file.read_text()).get("out", "o")


def test_truncate_keeps_chosen_layers(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    third = model.model.layers[3].mlp.up_proj.weight.clone()
    truncate_layers(model, [0, 3])
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, third)
    assert model.model.layers[1].self_attn.layer_idx == 1
    with pytest.raises(ValueError):
        truncate_layers(model, 5)


def test_batches_cover_every_example_once_and_respect_budget():
    exs = [Example(str(i), list(range(5 + i % 17)), 2) for i in range(100)]
    batches = make_batches(exs, 64, seed=1, epoch=0)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(100))
    assert all(len(b) * max(len(exs[i].input_ids) for i in b) <= 64 or len(b) == 1 for b in batches)
    assert make_batches(exs, 64, 1, 0) == batches and make_batches(exs, 64, 1, 1) != batches


def test_simulated_acceptance_equals_real_greedy_drafts(tiny_target):
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    draft = truncate_layers(AutoModelForCausalLM.from_pretrained(tiny_target).eval(), 3)
    rng = random.Random(5)
    exs = []
    for i in range(4):
        prompt = [rng.randrange(3, 300) for _ in range(6 + i)]
        completion = greedy_decode(target, [prompt], 32, stop_at_eos=False)[0].tokens
        exs.append(Example(f"e{i}", prompt + completion, len(prompt)))
    stats = simulated_acceptance(draft, exs, k=8)
    # Independently: real greedy drafts from the context at each offset.
    real = []
    for ex in exs:
        for off in range(0, 32 - 8 + 1, 8):
            ctx = ex.input_ids[: ex.prompt_len + off]
            d = greedy_decode(draft, [ctx], 8, stop_at_eos=False)[0].tokens
            real.append(accepted_length(d, ex.completion[off:off + 8]))
    assert stats.points == len(real)
    assert stats.accepted_total == sum(real)


def _mixed_batch(rng: random.Random) -> list[Example]:
    """Rows of different prompt and completion lengths: right padding leaves each its own scored positions."""
    return [Example(f"m{i}", [rng.randrange(3, 300) for _ in range(p + c)], p)
            for i, (p, c) in enumerate([(3, 9), (11, 4), (7, 7), (1, 12)])]


def test_the_head_at_the_scored_positions_alone_trains_as_the_full_head(tiny_target):
    """The training loss and its gradients, with the vocabulary head run at the labelled positions only, equal
    the naive ones: the head at every position, then the labelled ones picked out (QAT on, as the demo trains)."""
    model = truncate_layers(AutoModelForCausalLM.from_pretrained(tiny_target), 2)
    enable_qat(model, 32)
    batch = collate(_mixed_batch(random.Random(2)), 0, "cpu")
    teacher = torch.randn(4, batch["input_ids"].shape[1], model.config.vocab_size)  # [B, T, V]

    def loss_and_grads(kept_head: bool):
        model.zero_grad()
        labels = batch["labels"]
        if kept_head:
            scored = scored_positions(labels)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           logits_to_keep=scored).logits
            loss, _ = distill_loss(logits, labels, teacher[scored], 0.5, 2.0)
        else:  # the naive reference
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            keep = labels[:, 1:] != -100
            student, target = logits[keep], teacher[:, :-1][keep]
            kl = torch.nn.functional.kl_div(torch.log_softmax(student / 2, -1), torch.log_softmax(target / 2, -1),
                                            log_target=True, reduction="batchmean") * 4
            loss = 0.5 * torch.nn.functional.cross_entropy(student, labels[:, 1:][keep]) + 0.5 * kl
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    kept_loss, kept_grads = loss_and_grads(True)
    full_loss, full_grads = loss_and_grads(False)
    assert kept_loss == pytest.approx(full_loss, rel=1e-5)
    assert kept_grads.keys() == full_grads.keys() and len(kept_grads) > 10
    for name, grad in full_grads.items():
        torch.testing.assert_close(kept_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_heldout_loss_is_the_mean_cross_entropy_of_each_example_alone(tiny_target):
    model = truncate_layers(AutoModelForCausalLM.from_pretrained(tiny_target), 2).eval()
    examples = _mixed_batch(random.Random(3))
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0]  # [T, V]
            total += float(torch.nn.functional.cross_entropy(
                logits[ex.prompt_len - 1:-1], torch.tensor(ex.completion), reduction="sum"))
            count += len(ex.completion)
    assert heldout_loss(model, examples, pad_id=0) == pytest.approx(total / count, rel=1e-5)


def test_training_improves_and_writes_artifacts(tiny_traces, tiny_target, tmp_path):
    cfg = _cfg(tiny_traces, tiny_target, tmp_path / "ckpt", epochs=4, eval_every=10)
    train_set, _ = split_heldout(read_traces(tiny_traces, cfg.max_seq_len), cfg.heldout_fraction)
    init = truncate_layers(AutoModelForCausalLM.from_pretrained(tiny_target), 2)
    meta = run_train(cfg)
    # Random-model traces do not generalise across prompts; the fit to the training traces must improve.
    best = meta["best"]
    assert best["sim_accept"] == max(h["sim_accept"] for h in meta["history"])
    final_fit = meta["final"]["train_loss"]
    assert final_fit < heldout_loss(init, train_set, pad_id=0) - 0.3
    out = tmp_path / "ckpt"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "train_curves.png").stat().st_size > 0
    saved = json.loads((out / "train_meta.json").read_text())
    assert saved["traces"]["count"] == 40 and len(saved["traces"]["sha256"]) == 64
    assert saved["init"]["truncate_layers"] == 2
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.num_hidden_layers == 2


def test_resume_after_interruption_matches_uninterrupted_run(tiny_traces, tiny_target, tmp_path, monkeypatch):
    full = _cfg(tiny_traces, tiny_target, tmp_path / "full", max_steps=8)
    run_train(full)
    part = _cfg(tiny_traces, tiny_target, tmp_path / "part", max_steps=8)
    # "Kill" the same run in the middle of step 6, after the step-4 checkpoint was written.
    original = train_stage.lr_at

    class Killed(Exception):
        pass

    def killing_lr(step, total, cfg):
        if step == 5:  # the 6th optimizer step
            raise Killed
        return original(step, total, cfg)

    with monkeypatch.context() as patch:
        patch.setattr(train_stage, "lr_at", killing_lr)
        with pytest.raises(Killed):
            run_train(part)
    killed_state = json.loads((tmp_path / "part" / "last" / "trainer_state.json").read_text())
    assert killed_state["step"] == 4 and killed_state["train_seconds"] > 0
    run_train(part)
    a = load_file(tmp_path / "full" / "last" / "model.safetensors")
    b = load_file(tmp_path / "part" / "last" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the record counts the tokens of every sitting once: the steps redone after the kill are not counted twice
    whole, resumed = (json.loads((tmp_path / d / "train_meta.json").read_text()) for d in ("full", "part"))
    assert whole["resumed_from_step"] == 0 and whole["train_tokens"] == whole["train_tokens_this_run"] > 0
    assert resumed["resumed_from_step"] == 4 and resumed["train_tokens"] == whole["train_tokens"]
    assert 0 < resumed["train_tokens_this_run"] < resumed["train_tokens"]
    assert resumed["train_seconds"] > killed_state["train_seconds"] and resumed["seconds_this_run"] > 0


def test_a_kill_between_the_checkpoint_renames_resumes_from_the_complete_new_state(tiny_traces, tiny_target,
                                                                                    tmp_path, monkeypatch):
    """save_resume_state moves last/ aside, then last.tmp to last/: killed in between, no last/ is left, and the
    resume takes the complete last.tmp (step 4 here) rather than starting again from step 0."""
    full = _cfg(tiny_traces, tiny_target, tmp_path / "full", max_steps=8)
    run_train(full)
    part = _cfg(tiny_traces, tiny_target, tmp_path / "part", max_steps=8)
    original = train_stage.os.replace

    class Killed(Exception):
        pass

    def killing_replace(src, dst):
        if Path(src).name == "last.tmp" and json.loads((Path(src) / "trainer_state.json").read_text())["step"] == 4:
            raise Killed
        return original(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(train_stage.os, "replace", killing_replace)
        with pytest.raises(Killed):
            run_train(part)
    assert not (tmp_path / "part" / "last").exists() and (tmp_path / "part" / "last.tmp").is_dir()
    run_train(part)
    resumed = json.loads((tmp_path / "part" / "train_meta.json").read_text())
    assert resumed["resumed_from_step"] == 4
    a = load_file(tmp_path / "full" / "last" / "model.safetensors")
    b = load_file(tmp_path / "part" / "last" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "part" / "last.tmp").exists() and not (tmp_path / "part" / "last.old").exists()


def test_resume_refuses_a_corrupt_checkpoint_with_its_path(tiny_traces, tiny_target, tmp_path):
    cfg = _cfg(tiny_traces, tiny_target, tmp_path / "run", max_steps=2, eval_every=2)
    run_train(cfg)
    last = tmp_path / "run" / "last"
    weights = last / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(ValueError, match=f"cannot resume: corrupt weight file: {weights}: truncated"):
        run_train(cfg)
    state = json.loads((last / "trainer_state.json").read_text())
    (last / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "config"}))
    with pytest.raises(ValueError, match="trainer_state.json: not a trainer state"):
        run_train(cfg)


def test_the_target_is_read_from_the_summary_beside_traces_of_any_name(tiny_traces, tiny_target, tmp_path):
    """X.jsonl's target is the one X.summary.json records (the traces stage's naming), whatever X is; a
    traces.summary.json beside it belongs to other traces and is not read."""
    traces = tmp_path / "t.jsonl"
    shutil.copy(tiny_traces, traces)
    summary = tmp_path / "t.summary.json"
    summary.write_text(json.dumps({"stage": "traces", "target": {"spec": str(tiny_target)}}))
    other = {"stage": "traces", "target": {"spec": str(tmp_path / "another-target")}}
    (tmp_path / "traces.summary.json").write_text(json.dumps(other))
    meta = run_train(_cfg(traces, tiny_target, tmp_path / "ckpt", target=None, max_steps=1))
    assert meta["config"]["target"] is None
    assert meta["target"]["spec"] == str(tiny_target)  # not the embedded default, nor the other summary's
    assert meta["traces"]["summary_sha256"] == sha256_file(summary)


def test_tokenizer_mismatch_is_refused(tiny_traces, tiny_target, tmp_path):
    other = build_tiny_model(tmp_path / "other", "llama", vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer differs"):
        run_train(_cfg(tiny_traces, tiny_target, tmp_path / "x", init=str(other)))


@pytest.mark.parametrize("line, says", [
    ('{"id": "a", "prompt_ids": [1, 2], "completion_ids": [3, 4]', "traces.jsonl:2: not valid JSON"),
    ('[1, 2, 3]', "traces.jsonl:2: expected a JSON object with an 'id'"),
    ('{"id": "a", "prompt_ids": [1, 2]}', "traces.jsonl:2: field 'completion_ids' must be a list of token ids"),
    ('{"id": "a", "prompt_ids": [1, 2], "completion_ids": "34"}', "field 'completion_ids' must be a list"),
    ('{"id": "a", "prompt_ids": [1, -2], "completion_ids": [3]}', "field 'prompt_ids' holds a negative token id"),
    ('{"id": "a", "prompt_ids": [1], "completion_ids": [3, 4], "target_ids": [5]}', "1 target_ids for 2"),
])
def test_a_bad_traces_row_is_refused_with_its_line_and_field(tmp_path, line, says):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"id": "ok", "prompt_ids": [1, 2], "completion_ids": [3, 4]}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(says)):
        read_traces(path, 64)


def test_traces_beyond_the_drafts_vocab_are_refused(tiny_traces, tiny_target, tmp_path):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"id": "h", "prompt_ids": [1, 2], "completion_ids": [3, 10_000]}) + "\n")
    with pytest.raises(ValueError, match="heldout.jsonl uses token id 10000 but the draft's vocab has"):
        run_train(_cfg(tiny_traces, tiny_target, tmp_path / "x", heldout_traces=str(heldout)))


def test_qat_computes_on_the_packed_weights_and_still_learns(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen, as in training: quantised once
    model.model.layers[0].requires_grad_(False)  # a frozen layer is packed too, so it computes quantised
    reference = AutoModelForCausalLM.from_pretrained(tiny_target)
    with torch.no_grad():
        for module in reference.modules():  # every linear layer and the (tied) embedding, as the packer does
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(q4g.fake_quantize(module.weight, 32))
    assert enable_qat(model, 32) == 4 * 7 + 2  # q, k, v, o, gate, up, down in each of 4 layers; embedding, head
    ids = torch.tensor([[5, 9, 33, 70, 12, 8]])
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert not any(k.endswith("_qat_weight") for k in model.state_dict())  # checkpoints keep the float weights
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # straight-through: every trained weight gets a gradient
    trained = [m.weight.grad for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad]
    assert len(trained) == 3 * 7 and all(g is not None and g.abs().sum() > 0 for g in trained)


def test_qat_keeps_a_frozen_layer_on_its_finer_grid(tiny_target):
    """The pack stores a weight that sits exactly on a G=32 grid at G=32, unchanged; QAT at G=64 must compute
    with that same weight, not a re-rounded one."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    layer0 = [m for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in layer0:
            m.weight.copy_(q4g.dequantize(q4g.quantize(m.weight, 32)))
    model.model.layers[0].requires_grad_(False)
    enable_qat(model, 64)
    assert all(torch.equal(m._qat_weight, m.weight) for m in layer0)
    up = model.model.layers[1].mlp.up_proj  # trainable, on no grid: rounded at G=64 in every forward
    x = torch.randn(2, up.in_features)
    assert torch.equal(up(x), torch.nn.functional.linear(x, q4g.fake_quantize(up.weight, 64)))


def test_qat_training_scores_the_model_that_packing_will_produce(tiny_traces, tiny_target, tmp_path):
    cfg = _cfg(tiny_traces, tiny_target, tmp_path / "qat", epochs=1, eval_every=3, qat_group_size=32)
    meta = run_train(cfg)
    assert meta["config"]["qat_group_size"] == 32
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "qat").eval()  # plain HF weights: the latent floats
    # raw f32: QAT does not round norms to fp16 (the default raw encoding, a ~1e-4 relative effect)
    run_pack(PackConfig(checkpoint=str(tmp_path / "qat"), out=str(tmp_path / "packed"), group_size=32,
                        raw_encoding="f32"))
    packed, _ = load_packed_model(tmp_path / "packed")
    _, heldout = split_heldout(read_traces(tiny_traces, cfg.max_seq_len), cfg.heldout_fraction)
    ids = torch.tensor([heldout[0].input_ids])
    assert not torch.equal(packed(input_ids=ids).logits, saved(input_ids=ids).logits)  # rounding matters here
    # What training selected and scored is exactly what the packed file computes.
    assert simulated_acceptance(packed, heldout, cfg.num_draft, 0).mean_accepted_pooled == meta["best"]["sim_accept"]
    assert heldout_loss(packed, heldout, 0) == pytest.approx(meta["best"]["heldout_loss"], rel=1e-5)


# ------------------------------------------------------------------------ distillation from stored top-K

def _stored_batch(teacher_logits: torch.Tensor, k: int, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """As collate lays it out: the distribution that predicts the token at position t is stored at t (the
    teacher's logits at t - 1)."""
    values, ids = torch.log_softmax(teacher_logits, -1).topk(k, -1)
    values, ids = torch.roll(values, 1, dims=1), torch.roll(ids, 1, dims=1)
    return {"labels": labels, "top_ids": ids, "top_logprobs": values, "top_mask": labels != -100}


def test_stored_kd_over_the_whole_vocabulary_is_the_full_kl():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 1, 4], [-100, 2, 2, 5, 0]])
    scored = scored_positions(labels)
    for t in (1.0, 2.0):
        full, parts_full = distill_loss(student[scored], labels, teacher[scored], 0.5, t)
        stored, parts = stored_kd_loss(student[scored], _stored_batch(teacher, 7, labels), 0.5, t)
        assert float(stored) == pytest.approx(float(full), rel=1e-5)
        assert parts["kl"] == pytest.approx(parts_full["kl"], rel=1e-5)


def test_stored_kd_with_top_k_renormalises_the_teachers_k_and_reads_the_draft_there():
    torch.manual_seed(1)
    student, teacher = torch.randn(1, 3, 9), torch.randn(1, 3, 9)
    labels = torch.tensor([[-100, 4, 6]])
    batch = _stored_batch(teacher, 3, labels)
    batch["top_mask"][0, 2] = False  # the last position has no stored distribution: CE only
    _, parts = stored_kd_loss(student[scored_positions(labels)], batch, 1.0, 1.0)
    # by hand: position 0 predicts token 1, the only one with a stored distribution (the teacher's at 0)
    p = torch.softmax(batch["top_logprobs"][0, 1], -1)
    q = torch.log_softmax(student[0, 0], -1)[batch["top_ids"][0, 1]]
    assert parts["kl"] == pytest.approx(float((p * (p.log() - q)).sum()), rel=1e-5)
    ce = torch.nn.functional.cross_entropy(student[0, :2], labels[0, 1:])
    assert parts["ce"] == pytest.approx(float(ce), rel=1e-5)


@pytest.mark.parametrize("fields, says", [
    ({"top_ids": [[3, 1]], "top_logprobs": [[-0.1, -2.0]]}, "one list per completion token (2)"),
    ({"top_ids": [[3, 1], [4, 4]], "top_logprobs": [[-0.1, -2.0], [-0.1, -3.0]]}, "top_ids[1] / top_logprobs[1]"),
    ({"top_ids": [[3, 1], [4, 2]], "top_logprobs": [[-0.1, -2.0], [-3.0, -0.1]]}, "most likely first"),
    ({"top_ids": [[3, 1], [4, 2]], "top_logprobs": [[0.5, -2.0], [-0.1, -3.0]]}, "<= 0"),
    ({"top_ids": [[3, 1], [4, 2]]}, "fields 'top_ids' and 'top_logprobs'"),
])
def test_a_bad_stored_distribution_is_refused_with_its_line(tmp_path, fields, says):
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt_ids": [1, 2], "completion_ids": [3, 4], **fields}) + "\n")
    with pytest.raises(ValueError, match=re.escape(says)):
        read_traces(path, 64)


@pytest.fixture(scope="module")
def tiny_traces_with_top_k(tmp_path_factory, tiny_target):
    from specdraft.stages.traces import TracesConfig, run_traces
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    root = tmp_path_factory.mktemp("traces_topk")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "source": "test", "prompt": " ".join(
        rng.choice(["the", "fox", "code", "list", "sum", "robot", "Paris"]) for _ in range(rng.randrange(3, 12)))})
        + "\n" for i in range(40)))
    del model
    run_traces(TracesConfig(target=str(tiny_target), prompts=prompts, out=root / "traces.jsonl", max_new_tokens=24,
                            top_logprobs=8, device="cpu"))
    return root / "traces.jsonl"


def test_traces_keep_the_targets_top_k_and_training_distils_from_it(tiny_traces_with_top_k, tiny_target, tmp_path):
    rows = [json.loads(line) for line in tiny_traces_with_top_k.read_text().splitlines()]
    assert all(len(r["top_ids"]) == len(r["completion_ids"]) == len(r["top_logprobs"]) for r in rows)
    assert all(ids[0] == tok and len(ids) == 8 for r in rows for ids, tok in zip(r["top_ids"], r["completion_ids"]))
    examples = read_traces(tiny_traces_with_top_k, 64)
    assert all(ex.top_ids is not None and len(ex.top_ids) == len(ex.completion) for ex in examples)
    meta = run_train(_cfg(tiny_traces_with_top_k, tiny_target, tmp_path / "kd", kd_stored=True, kd_weight=0.5,
                          epochs=4))
    # random-model traces do not generalise across prompts: the mixed loss must fall on the training rows
    assert meta["history"][-1]["train_loss"] < 0.8 * meta["history"][1]["train_loss"]
    ce = run_train(_cfg(tiny_traces_with_top_k, tiny_target, tmp_path / "ce", epochs=4))
    assert ce["history"][-1]["train_loss"] != meta["history"][-1]["train_loss"]  # the KL term took part
    assert json.loads((tmp_path / "kd" / "train_meta.json").read_text())["config"]["kd_stored"] is True


def test_kd_stored_needs_traces_that_kept_a_distribution(tiny_traces, tiny_target, tmp_path):
    with pytest.raises(ValueError, match="--top-logprobs K"):
        run_train(_cfg(tiny_traces, tiny_target, tmp_path / "x", kd_stored=True))
    with pytest.raises(ValueError, match="choose one teacher"):
        _cfg(tiny_traces, tiny_target, tmp_path / "y", kd_stored=True, kd=True)


# ------------------------------------------------------------------------------------------- precision

AVX2 = {"capability": "AVX2", "avx512_bf16": False, "amx": False}


def _measuring(patch, bf16_time: float, calls: list | None = None) -> None:
    """``auto`` on this CPU times with a fake: bf16 takes ``bf16_time`` times float32's time, on any machine."""
    real = train_stage.resolve_train_precision

    def measure(precision, shape, rows):
        if calls is not None:
            calls.append(precision)
        return 1e-3 * (bf16_time if precision == "bf16" else 1.0)
    patch.setattr(train_stage, "resolve_train_precision", lambda *a, **k: real(*a, **k, measure=measure, cpu=AVX2))


def _recording_precision(patch, used: list) -> None:
    """Record the mixed precision accelerate trains each micro-batch in."""
    original = train_stage.train_step

    def train_step(run, batch, step):
        used.append((run.accelerator.mixed_precision, run.accelerator.native_amp))
        return original(run, batch, step)
    patch.setattr(train_stage, "train_step", train_step)


@pytest.mark.parametrize("setting, bf16_time, expected", [("auto", 0.5, "bf16"), ("auto", 0.9, "no"),
                                                          ("no", 0.5, "no")])
def test_auto_on_a_cpu_trains_in_the_precision_it_measured_and_records_why(tiny_traces, tiny_target, tmp_path,
                                                                           monkeypatch, setting, bf16_time, expected):
    """bf16 twice as fast: bf16; 1.1x: under the margin, float32; an explicit setting: as given, not measured.
    (bf16 first: a later run in the same process trains in another precision.)"""
    calls: list = []
    used: list = []
    _measuring(monkeypatch, bf16_time, calls)
    _recording_precision(monkeypatch, used)
    out = tmp_path / "run"
    meta = run_train(_cfg(tiny_traces, tiny_target, out, max_steps=2, eval_every=2, mixed_precision=setting))
    assert set(used) == {(expected, expected == "bf16")}
    choice = meta["precision_choice"]
    assert (choice["precision"], choice["requested"], choice["given"]) == (expected, setting, setting != "auto")
    assert not choice["kept_from_first_sitting"]
    if setting == "auto":
        assert set(calls) == {"no", "bf16"} and choice["reason"].startswith("measured one training step's")
        assert choice["measured"]["float32"]["seconds_per_step"] > 0 and choice["measured"]["bf16"]
        assert choice["rows"]["rows"] == 256 and 0 < choice["rows"]["head_rows"] < 256  # the labelled share
    else:
        assert calls == [] and choice["reason"] == "--mixed-precision no"
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    assert state["precision_choice"] == {k: v for k, v in choice.items() if k != "kept_from_first_sitting"}
    name = {"no": "float32", "bf16": "bf16"}[expected]
    assert f"mixed precision: {name}, {choice['reason']}" in (out / "train.log").read_text()


def test_a_resumed_run_keeps_the_precision_its_first_sitting_chose(tiny_traces, tiny_target, tmp_path,
                                                                     monkeypatch):
    """The first sitting measured bf16 faster; the second would measure float32 faster, but does not measure: it
    trains on in bf16, to the weights of an uninterrupted bf16 run."""
    with monkeypatch.context() as patch:
        _measuring(patch, 0.5)
        full = run_train(_cfg(tiny_traces, tiny_target, tmp_path / "full", max_steps=8))
    assert full["precision_choice"]["precision"] == "bf16"
    part = _cfg(tiny_traces, tiny_target, tmp_path / "part", max_steps=8)
    original = train_stage.lr_at

    class Killed(Exception):
        pass

    def killing_lr(step, total, cfg):
        if step == 5:
            raise Killed
        return original(step, total, cfg)

    with monkeypatch.context() as patch:
        _measuring(patch, 0.5)
        patch.setattr(train_stage, "lr_at", killing_lr)
        with pytest.raises(Killed):
            run_train(part)
    calls: list = []
    used: list = []
    with monkeypatch.context() as patch:
        _measuring(patch, 3.0, calls)  # bf16 now far slower: a new measurement would pick float32
        _recording_precision(patch, used)
        resumed = run_train(part)
    assert resumed["resumed_from_step"] == 4 and calls == [] and set(used) == {("bf16", True)}
    choice = resumed["precision_choice"]
    assert choice["kept_from_first_sitting"] and choice["precision"] == "bf16"
    assert {k: v for k, v in choice.items() if k != "kept_from_first_sitting"} == \
        {k: v for k, v in full["precision_choice"].items() if k != "kept_from_first_sitting"}  # the first's figures
    a = load_file(tmp_path / "full" / "last" / "model.safetensors")
    b = load_file(tmp_path / "part" / "last" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_state_that_recorded_no_choice_resumes_in_float32_on_a_cpu(tiny_traces, tiny_target, tmp_path,
                                                                      monkeypatch):
    """A resume state written before the choice was recorded trained under auto's earlier rule: float32 on a CPU."""
    cfg = _cfg(tiny_traces, tiny_target, tmp_path / "run", max_steps=2, eval_every=2)
    run_train(cfg)
    state_file = tmp_path / "run" / "last" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({k: v for k, v in state.items() if k != "precision_choice"}))
    calls: list = []
    _measuring(monkeypatch, 0.5, calls)  # measured, bf16 would win
    choice = run_train(cfg)["precision_choice"]
    assert calls == [] and choice["precision"] == "no" and choice["kept_from_first_sitting"]
    assert "recorded no choice" in choice["reason"]


def test_measuring_leaves_a_float32_run_as_it_was(tiny_traces, tiny_target, tmp_path, monkeypatch):
    """auto, measured with the real timer and then training in float32, trains the weights and leaves the RNG state
    of a run given float32 outright: the measurement is no part of the run."""
    real = train_stage.resolve_train_precision

    def measured_then_float32(*args, **kwargs):
        return {**real(*args, **kwargs), "precision": "no"}  # on any machine: the pick is not what is tested here
    monkeypatch.setattr(train_stage, "resolve_train_precision", measured_then_float32)
    runs = {setting: run_train(_cfg(tiny_traces, tiny_target, tmp_path / setting, max_steps=4, eval_every=4,
                                    mixed_precision=setting)) for setting in ("auto", "no")}
    assert runs["auto"]["precision_choice"]["measured"] and "measured" not in runs["no"]["precision_choice"]
    a, b = (load_file(tmp_path / s / "last" / "model.safetensors") for s in ("auto", "no"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rng = [torch.load(tmp_path / s / "last" / "random_states_0.pkl", weights_only=False) for s in ("auto", "no")]
    assert torch.equal(rng[0]["torch_manual_seed"], rng[1]["torch_manual_seed"])
    assert rng[0]["random_state"] == rng[1]["random_state"]
