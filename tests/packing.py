"""What the pack and loader tests share: a float model, its logits, a batch of ids, and the reference size."""

import torch
from transformers import AutoModelForCausalLM

REFERENCE_QWEN3_1_7B_BYTES = 965_635_110  # Qwen3-1.7B's Q4_0 GGUF: the size the reference draft's pack compares to


def float_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def logits(model, ids):
    return model(input_ids=ids).logits.float()


def token_ids(vocab=300, seed=1):
    return torch.randint(0, vocab, (4, 48), generator=torch.Generator().manual_seed(seed))
