"""What the pipeline refuses at the start, and what only falls back (model.compat), on tiny models."""

import json
import shutil

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from specdraft.model.compat import UnsupportedModelError, check_pipeline_models
from specdraft.model.tiny import build_tiny_model, build_tiny_tokenizer


def test_a_qwen3_target_with_a_template_passes_with_the_lean_forward_and_gguf(tiny_qwen3_dir):
    found = check_pipeline_models(str(tiny_qwen3_dir), f"truncate:{tiny_qwen3_dir}:1")
    assert found.model_type == "qwen3" and found.lean_forward and found.gguf_export and not found.notes
    assert found.vocab_rows >= found.tokenizer_entries


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_reason(tiny_qwen3_dir, tmp_path):
    plain = shutil.copytree(tiny_qwen3_dir, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        check_pipeline_models(str(plain))


def test_a_draft_start_with_another_tokenizer_is_refused(tiny_qwen3_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", "qwen3", vocab_size=300)
    with pytest.raises(UnsupportedModelError, match="tokenizer is not the target's") as e:
        check_pipeline_models(str(tiny_qwen3_dir), str(other))
    assert str(other) in str(e.value)


def test_an_embedding_smaller_than_the_tokenizer_is_refused(tiny_qwen3_dir, tmp_path):
    small = shutil.copytree(tiny_qwen3_dir, tmp_path / "small")
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 10
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="embedding of 10 rows"):
        check_pipeline_models(str(small))


def test_a_model_the_lean_forward_and_gguf_do_not_cover_falls_back(tmp_path):
    tokenizer = build_tiny_tokenizer()
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    tokenizer.save_pretrained(tmp_path / "mistral")
    found = check_pipeline_models(str(tmp_path / "mistral"))
    assert not found.lean_forward and not found.gguf_export
    assert any("transformers' forward" in n for n in found.notes)
    assert any("Hugging Face export" in n for n in found.notes)
