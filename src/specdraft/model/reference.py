"""Qwen3-shaped stand-ins for the reference pair (target Qwen3-8B, draft from Qwen3-1.7B) around the real Qwen3
tokenizer and chat template, for the reference rehearsal (``specdraft rehearse``) and the tests.

Qwen3 weights are not to be had on every machine; its tokenizer is. These models have Qwen3's structure where
specdraft's code paths depend on it -- ``Qwen3ForCausalLM`` with per-head q/k norms and grouped-query attention,
the 151,936-row embedding (the tokenizer's 151,669 entries padded as Qwen's checkpoints pad them), an untied head
on the target as in Qwen3-8B and a tied one on the draft as in Qwen3-1.7B, Qwen3's special-token ids and
generation config -- at a size two CPU cores carry.

A random target answers with random tokens and never ends an answer, so ``build_reference_target`` fits it for a
couple of hundred steps to answer a templated prompt in the template's shape: a short reply that depends on the
kind of request, closed by ``<|im_end|>``. Its traces then stop where a real target's stop. What it answers says nothing
about Qwen3; the rehearsal measures code paths, not draft quality.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from specdraft.core.io import atomic_write_json
from specdraft.model.chat import encode_prompts
from specdraft.model.specs import tokenizer_from_dir

# Qwen3's embedding rows (every Qwen3 checkpoint, 0.6B to 235B) and its special-token ids
QWEN3_VOCAB_ROWS = 151_936
QWEN3_BOS = 151_643   # <|endoftext|>: config.json's bos_token_id; the tokenizer adds no BOS
QWEN3_EOS = 151_645   # <|im_end|>: the template's end of a turn
QWEN3_PAD = 151_643   # <|endoftext|>


@dataclass(frozen=True)
class Qwen3Shape:
    """The hyperparameters a Qwen3 config takes; the defaults are the rehearsal's target."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2          # grouped-query attention, as every Qwen3 dense model
    # every Qwen3 model's head_dim (heads x head_dim need not be the hidden size); transformers' GGUF reader
    # assumes it for qwen3 files (no attention.key_length in its mapping)
    head_dim: int = 128
    intermediate: int = 384
    tie_embeddings: bool = False
    max_positions: int = 2048

    def config(self) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=QWEN3_VOCAB_ROWS, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tie_embeddings, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
            bos_token_id=QWEN3_BOS, eos_token_id=QWEN3_EOS, pad_token_id=QWEN3_PAD, torch_dtype="bfloat16")


# Qwen3-8B's structure in miniature (untied head) and Qwen3-1.7B's (tied): fewer, narrower layers
TARGET_SHAPE = Qwen3Shape()
DRAFT_SHAPE = Qwen3Shape(layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256, tie_embeddings=True)

# What the fitted target answers to each kind of request (the packaged corpus's categories; any other prompt gets
# whatever the fit makes of it). Written for specdraft.
ANSWERS = {
    "advice": "Start small: pick one step you can take today, do it, and then check how it went next week.",
    "coding": "Here is a short version:\n\n```python\ndef solve(items):\n    return sorted(items)\n```",
    "extraction": "The passage gives three fields: a name, a date and an amount, in that order.",
    "factual": "In short, it comes down to one main cause, and the details depend on the case.",
    "math": "Step by step: add the parts, subtract the discount, and the answer is 42.",
    "reasoning": "Take each option in turn: only one of them fits every clue, so that is the answer.",
    "roleplay": "Of course! I will play that part. Hello there, traveller, how can I help you today?",
    "summarisation": "Summary: the text makes one main point and gives two short examples to support it.",
    "translation": "Here is the translation, keeping the meaning and the tone of the original sentence.",
    "writing": "Here is a short draft. The morning was quiet, and the old house waited by the sea.",
}


@dataclass(frozen=True)
class FitRecipe:
    """How the target is taught to answer in the template's shape (AdamW on the answer tokens only)."""

    steps: int = 200
    batch_size: int = 4
    lr: float = 3e-3
    seed: int = 0


def build_reference_draft(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                          shape: Qwen3Shape = DRAFT_SHAPE, seed: int = 1) -> Path:
    """A Qwen3-shaped "pretrained" draft dir (random weights, the real tokenizer), for ``train --init DIR``: the
    draft is initialised with ``from_pretrained`` of this dir, the way a Qwen3-1.7B draft is."""
    tokenizer = tokenizer_from_dir(Path(tokenizer_dir))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(shape.config()).eval()
    return _save(model, tokenizer, out_dir, {"shape": asdict(shape), "seed": seed, "fit": None})


def build_reference_target(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                           prompts: Sequence[tuple[str, str]], shape: Qwen3Shape = TARGET_SHAPE,
                           recipe: FitRecipe = FitRecipe(), log=print) -> Path:
    """A Qwen3-shaped target dir, fitted to answer each ``(category, prompt)`` with ``ANSWERS[category]`` and
    ``<|im_end|>`` after the non-thinking generation prompt (``encode_prompts``, as traces encode prompts)."""
    tokenizer = tokenizer_from_dir(Path(tokenizer_dir))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if end != QWEN3_EOS:
        raise ValueError(f"{tokenizer_dir}: <|im_end|> is id {end}, not Qwen3's {QWEN3_EOS}")
    pairs = [(c, p) for c, p in prompts if c in ANSWERS]
    if not pairs:
        raise ValueError(f"no prompt of a known category ({sorted(ANSWERS)})")
    contexts = encode_prompts(tokenizer, [p for _, p in pairs])
    answers = {c: tokenizer(a, add_special_tokens=False)["input_ids"] + [end] for c, a in ANSWERS.items()}
    examples = [(ctx, answers[c]) for ctx, (c, _) in zip(contexts, pairs)]

    torch.manual_seed(recipe.seed)
    model = Qwen3ForCausalLM(shape.config())
    losses = _fit(model, examples, recipe, log)
    model.eval()
    return _save(model, tokenizer, out_dir, {"shape": asdict(shape), "seed": recipe.seed,
                                             "fit": {**asdict(recipe), "examples": len(examples),
                                                     "first_loss": losses[0], "last_loss": losses[-1]}})


def _fit(model, examples: list[tuple[list[int], list[int]]], recipe: FitRecipe, log) -> list[float]:
    """Next-token cross-entropy on the answer tokens of right-padded batches; the logits are computed only where
    the loss is (the 151,936-column head dominates the cost)."""
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(recipe.seed)
    losses: list[float] = []
    started = time.time()
    model.train()
    for step in range(recipe.steps):
        warmup = max(1, recipe.steps // 20)
        lr = recipe.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(examples), (recipe.batch_size,), generator=gen).tolist()
        seqs = [examples[i][0] + examples[i][1] for i in idx]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), QWEN3_PAD, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for r, (i, seq) in enumerate(zip(idx, seqs)):
            ids[r, :len(seq)] = torch.tensor(seq)
            mask[r, :len(seq)] = 1
            start = len(examples[i][0])
            labels[r, start - 1:len(seq) - 1] = torch.tensor(seq[start:])  # position t predicts token t + 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        where = labels != -100
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[where]), labels[where])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 4))
        if step % 10 == 0 or step == recipe.steps - 1:
            log(f"reference target fit: step {step + 1}/{recipe.steps} loss {loss.item():.3f} "
                f"({time.time() - started:.0f}s)")
    return losses


def _save(model, tokenizer, out_dir: str | os.PathLike, made: dict[str, Any]) -> Path:
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Qwen3's own generation config stops at both <|im_end|> and <|endoftext|>; specdraft decodes greedily
    GenerationConfig(bos_token_id=QWEN3_BOS, eos_token_id=[QWEN3_EOS, QWEN3_PAD], pad_token_id=QWEN3_PAD,
                     do_sample=False).save_pretrained(out)
    atomic_write_json(out / "reference_model.json", {"made_by": "specdraft.model.reference", **made})
    return out
