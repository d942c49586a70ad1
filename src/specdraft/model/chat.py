"""How a user prompt becomes the target's token ids: its chat template with the generation prompt added (thinking
off), or the raw text for a model without a template. Traces, validation, speculation and the audit all encode
prompts here, so a draft is measured on exactly the contexts it was trained on."""

from __future__ import annotations

from typing import Sequence


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompts(tokenizer, texts: Sequence[str], chat_template: bool = True) -> list[list[int]]:
    """Token ids of each prompt inside the chat template (generation prompt added, thinking off); raw
    text (with the tokenizer's own special tokens) when the tokenizer has no template or ``chat_template`` is
    False."""
    if chat_template and has_chat_template(tokenizer):
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  enable_thinking=False, tokenize=False) for t in texts]
        # transformers 5 returns a BatchEncoding from tokenize=True; render, then tokenize without extras.
        return [list(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    return [list(ids) for ids in tokenizer(list(texts))["input_ids"]]


def encode_conversation(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a conversation (``{"role", "content"}`` messages, ending with a user turn) as a chat server
    renders it for the next answer: the target's chat template, generation prompt added, thinking off. Training rows
    and evaluation points over later turns both encode here, so a draft trains on the contexts it is measured on."""
    if not has_chat_template(tokenizer):
        raise ValueError("a conversation needs a chat template, and the target's tokenizer has none")
    rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, enable_thinking=False,
                                             tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
