"""Tiny random-init models with a locally trained tokenizer, for tests and smoke runs (no downloads).

Like gpt-fast's tiny named sizes: the same code paths as a real model, a few layers and a small vocab.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list of numbers.",
    "def add(a, b):\n    return a + b\n",
    "Explain how speculative decoding speeds up a language model.",
    "Translate 'good morning' into French: bonjour.",
    "A draft model proposes tokens and the target model verifies them.",
    "What is 12 times 7? The answer is 84.",
    "Summarise the following paragraph in one sentence.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time there was a small robot who loved to read books.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
]


def build_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a small built-in corpus, with a chat template."""

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | os.PathLike, arch: str = "qwen3", *, layers: int = 2, hidden: int = 64,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 128, vocab_size: int = 320,
                     max_positions: int = 512, tie_embeddings: bool = True, seed: int = 0) -> Path:
    """Save a random-init Qwen3ForCausalLM or LlamaForCausalLM (plus tokenizer) as an HF directory."""

    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
                  eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    if arch == "qwen3":
        config, cls = Qwen3Config(head_dim=hidden // heads, **common), Qwen3ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r} (qwen3 | llama)")
    torch.manual_seed(seed)
    # A larger init than the default 0.02 so that random logits are well separated (stable argmax).
    config.initializer_range = 0.2
    model = cls(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False).save_pretrained(out)
    return out
