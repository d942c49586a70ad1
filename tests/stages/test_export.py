"""The export stage on tiny models, each export read back by a reader that is not specdraft's: transformers'
gguf_file= loader (which dequantises through gguf-py) for GGUF, transformers' assisted generation for HF."""

import json
import shutil

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from specdraft.cli import main
from specdraft.core.io import read_json, sha256_file
from specdraft.core.records import load_validation
from specdraft.model.decode import draft_batch
from specdraft.model.export import ASSISTED_GENERATION
from specdraft.model.loader import load_draft
from specdraft.model.simple_decode import transformers_greedy
from specdraft.model.tiny import build_tiny_model
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.traces import ValidationConfig, run_validation

PROMPTS = ["Explain how a draft model helps a large model.", "Write a short poem about rivers.",
           "What is 12 times 7?", "Name three colours of the rainbow.", "Describe a quiet morning.",
           "Give two tips for readable code.", "Translate good morning into French.", "Why is the sky blue?"]
NUM_DRAFT = 8


def _tiny(tmp_path_factory, arch: str):
    # transformers' GGUF reader takes a qwen3 head_dim from its default (128), not from the file's key_length:
    # the qwen3 model here has head_dim 128 so that the reader builds the model the file holds
    kw = {"llama": {}, "qwen3": dict(hidden=256, heads=2, kv_heads=1, intermediate=256)}[arch]
    return build_tiny_model(tmp_path_factory.mktemp(f"export_{arch}"), arch, **kw)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def packed(request, tmp_path_factory):
    """(float dir, packed dir, validation points of the model itself) for a tiny llama and a tiny qwen3."""
    src = _tiny(tmp_path_factory, request.param)
    root = tmp_path_factory.mktemp(f"packed_{request.param}")
    out = run_pack(PackConfig(checkpoint=str(src), out=str(root / "model"))).out
    prompts = root / "mt_bench.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "x", "turns": [p]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    run_validation(ValidationConfig(prompts=prompts, out=root / "validation.jsonl", target=str(src),
                                    max_new_tokens=48, num_draft=NUM_DRAFT, device="cpu"))
    return src, out, load_validation(root / "validation.jsonl", k=NUM_DRAFT)


def _export(model_dir, out, fmt="gguf", **kw):
    return run_export(ExportConfig(model_dir=str(model_dir), format=fmt, out=str(out), **kw))


# --------------------------------------------------------------------------------------------------- gguf

def test_gguf_read_back_by_transformers_drafts_what_the_packed_draft_drafts(packed, tmp_path):
    src, model_dir, points = packed
    res = _export(model_dir, tmp_path / "draft.gguf")
    record = read_json(res.record)
    assert res.exact and record["exact"] and record["not_exact"] == []
    assert record["tensor_types"]["Q4_1"] == sum(1 for t in record["tensors"] if len(t["shape"]) == 2)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="draft.gguf", dtype=torch.float32).eval()
    ours, _ = load_draft(model_dir, "float32")
    a, b = theirs.state_dict(), ours.state_dict()
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in b), [k for k in b if not torch.equal(a[k], b[k])]
    assert len(points) >= 24
    contexts = [p.context_ids for p in points]
    assert [transformers_greedy(theirs, c, NUM_DRAFT) for c in contexts] == draft_batch(ours, contexts, NUM_DRAFT)


def test_gguf_metadata_holds_the_tokenizer_and_chat_template(packed, tmp_path):
    src, model_dir, _ = packed
    _export(model_dir, tmp_path / "draft.gguf")
    reader = gguf.GGUFReader(tmp_path / "draft.gguf")
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tok = AutoTokenizer.from_pretrained(src)
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert field("tokenizer.chat_template") == tok.chat_template
    assert field("general.architecture") == json.loads((src / "config.json").read_text())["model_type"]
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="draft.gguf")
    assert back.get_vocab() == tok.get_vocab() and back.chat_template == tok.chat_template
    text = "Write a Python function: def add(a, b): return a + b"
    assert back(text)["input_ids"] == tok(text)["input_ids"]


def test_gguf_record_names_the_source_and_output(packed, tmp_path):
    _, model_dir, _ = packed
    res = _export(model_dir, tmp_path / "draft.gguf")
    assert res.record == tmp_path / "draft.gguf.export.json"
    record = read_json(res.record)
    assert record["source"]["kind"] == "qd4"
    assert record["source"]["weights_sha256"] == sha256_file(model_dir / "draft.qd4")
    assert record["output"] == {"file": "draft.gguf", "bytes": (tmp_path / "draft.gguf").stat().st_size,
                                "sha256": sha256_file(tmp_path / "draft.gguf")}
    assert {"git_sha", "versions", "created_at", "config", "tokenizer", "file_type"} <= set(record)
    header = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "draft.gguf").tensors}
    assert header == {t["gguf_name"]: t["type"] for t in record["tensors"]}


def test_grids_q4_1_cannot_hold_go_as_f32_or_are_named(tiny_llama_dir, tmp_path):
    packed = run_pack(PackConfig(checkpoint=str(tiny_llama_dir), out=str(tmp_path / "g16"), group_size=16)).out
    exact = read_json(_export(packed, tmp_path / "auto.gguf").record)
    assert exact["exact"] and set(exact["tensor_types"]) == {"F32"}
    rounded = read_json(_export(packed, tmp_path / "q4.gguf", dtype="q4_1").record)
    matrices = [t["name"] for t in rounded["tensors"] if len(t["shape"]) == 2]
    assert rounded["not_exact"] == matrices and rounded["tensor_types"]["Q4_1"] == len(matrices)
    assert all(t["max_abs_error"] > 0 for t in rounded["tensors"] if not t["exact"])


def test_float_checkpoint_goes_as_f16_or_exactly_as_f32(tiny_llama_dir, tmp_path):
    f16 = read_json(_export(tiny_llama_dir, tmp_path / "f16.gguf").record)
    matrices = [t["name"] for t in f16["tensors"] if len(t["shape"]) == 2]
    assert f16["source"]["kind"] == "hf" and f16["tensor_types"] == {"F16": len(matrices),
                                                                      "F32": len(f16["tensors"]) - len(matrices)}
    assert f16["not_exact"] == matrices  # float32 weights rounded to F16
    f32 = read_json(_export(tiny_llama_dir, tmp_path / "f32.gguf", dtype="f32").record)
    assert f32["exact"] and set(f32["tensor_types"]) == {"F32"}
    q4 = read_json(_export(tiny_llama_dir, tmp_path / "q4.gguf", dtype="q4_1").record)
    assert q4["tensor_types"]["Q4_1"] == len(matrices)


def test_unknown_pre_tokenizer_needs_to_be_named(tiny_llama_dir, tmp_path):
    src = shutil.copytree(tiny_llama_dir, tmp_path / "src")
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, tj["pre_tokenizer"]]}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match="--tokenizer-pre"):
        _export(src, tmp_path / "a.gguf")
    record = read_json(_export(src, tmp_path / "b.gguf", tokenizer_pre="smollm").record)
    assert record["tokenizer"]["pre"] == "smollm" and "given" in record["tokenizer"]["pre_from"]


@pytest.mark.parametrize("kwargs, message", [
    ({"format": "gguf", "dtype": "bfloat16"}, "--dtype for gguf"),
    ({"format": "hf", "dtype": "q4_1"}, "--dtype for hf"),
    ({"format": "gguf", "num_assistant_tokens": 3}, "hf options"),
    ({"format": "hf", "tokenizer_pre": "gpt-2"}, "gguf options"),
])
def test_config_combinations_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExportConfig(model_dir="x", out="y", **kwargs)


def test_existing_output_is_kept_unless_overwrite(tiny_llama_dir, tmp_path, capsys):
    (tmp_path / "d.gguf").write_text("keep")
    assert main(["export", str(tiny_llama_dir), "--format", "gguf", "--out", str(tmp_path / "d.gguf")]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "d.gguf").read_text() == "keep"
    assert main(["export", str(tiny_llama_dir), "--format", "gguf", "--out", str(tmp_path / "d.gguf"),
                 "--overwrite"]) == 0
    assert gguf.GGUFReader(tmp_path / "d.gguf").tensors
    assert main(["export", str(tmp_path / "nowhere"), "--format", "hf", "--out", str(tmp_path / "h")]) == 2


# ----------------------------------------------------------------------------------------------------- hf

def test_hf_export_is_a_plain_dir_with_the_drafts_settings(packed, tmp_path):
    src, model_dir, _ = packed
    res = _export(model_dir, tmp_path / "hf", fmt="hf", num_assistant_tokens=6)
    out = tmp_path / "hf"
    assert res.record == out / "export_record.json"
    record = read_json(res.record)
    assert {f["name"] for f in record["output"]["files"]} >= {"model.safetensors", "config.json",
                                                              "generation_config.json", "tokenizer.json"}
    assert all(sha256_file(out / f["name"]) == f["sha256"] for f in record["output"]["files"])
    gen = read_json(out / "generation_config.json")
    packed_gen = read_json(model_dir / "generation_config.json")
    assert gen == {**packed_gen, "num_assistant_tokens": 6}
    assert record["generation_config"] == {**ASSISTED_GENERATION, "num_assistant_tokens": 6}
    draft = AutoModelForCausalLM.from_pretrained(out)
    assert draft.dtype == torch.bfloat16 and draft.generation_config.num_assistant_tokens == 6
    ours, _ = load_draft(model_dir, "float32")
    b = ours.state_dict()
    assert all(torch.equal(v, b[k].to(torch.bfloat16)) for k, v in draft.state_dict().items())
    f32 = read_json(_export(model_dir, tmp_path / "hf32", fmt="hf", dtype="f32").record)
    assert f32["exact"] and not read_json(res.record)["exact"]


def test_assisted_generation_with_the_hf_export_is_the_targets_greedy(packed, tmp_path, monkeypatch):
    """transformers' generate(assistant_model=draft) returns the target's plain greedy output; the acceptance
    (target-verified draft tokens per step) is reported."""
    src, model_dir, points = packed
    _export(model_dir, tmp_path / "hf", fmt="hf")
    target = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    matches = []
    real = AssistedCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return real(self, input_ids, scores, num_matches)
    monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", record)
    pad = target.generation_config.pad_token_id
    for p in points[::4]:
        ids = torch.tensor([p.context_ids])
        plain = target.generate(ids, do_sample=False, max_new_tokens=32, pad_token_id=pad)
        assisted = target.generate(ids, do_sample=False, max_new_tokens=32, pad_token_id=pad, assistant_model=draft)
        assert assisted.tolist() == plain.tolist()
    accepted = sum(matches) / len(matches)
    print(f"assisted generation: {len(matches)} steps, {accepted:.2f} of "
          f"{ASSISTED_GENERATION['num_assistant_tokens']} draft tokens accepted per step")
    assert len(matches) > 0


# --------------------------------------------------------------------------------------------- real model

@pytest.mark.slow
def test_packed_smollm2_goes_to_gguf_exactly_and_llama_cpp_can_draft_for_its_target(tmp_path):
    """The embedded target packed with the defaults (its layers on their G=32 grid, the embedding at G=64): every
    tensor Q4_1 and exact; transformers reads the packed draft's weights back bit for bit; the metadata passes
    llama.cpp's draft/target vocabulary check against the target's own GGUF (read with gguf-py, the fields
    that check compares); the HF export drafts for the target in transformers' assisted generation."""
    from specdraft.model.specs import DEFAULT_TARGET, embedded_gguf_path, load_model

    packed = run_pack(PackConfig(checkpoint=DEFAULT_TARGET, out=str(tmp_path / "model"))).out
    record = read_json(_export(packed, tmp_path / "draft.gguf").record)
    assert record["exact"] and set(record["tensor_types"]) == {"Q4_1", "F32"}
    assert record["tokenizer"]["pre"] == "smollm" and record["file_type"] == "MOSTLY_Q4_1"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="draft.gguf", dtype=torch.float32)
    ours, _ = load_draft(packed, "float32")
    a, b = theirs.state_dict(), ours.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    target = gguf.GGUFReader(embedded_gguf_path(DEFAULT_TARGET.removeprefix("embedded:")))
    draft = gguf.GGUFReader(tmp_path / "draft.gguf")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"):
        assert draft.fields[key].contents() == target.fields[key].contents(), key

    _export(packed, tmp_path / "hf", fmt="hf")
    model = load_model(DEFAULT_TARGET).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 2, 198, 1,
                         4093, 198, 10180, 7635, 260, 1791, 282, 354, 2321, 31077, 2, 198, 1, 520, 9531, 198]])
    plain = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=2)
    assert model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=2,
                          assistant_model=hf_draft).tolist() == plain.tolist()
