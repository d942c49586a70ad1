"""A draft model in process, stateless: every call prefills its contexts and decodes ``num_tokens`` greedy
tokens with the shared decode loop (``model.decode.draft_batch``), as the draft server does. Sampled drafts
(``draft_with_probs``) and teacher-forced distributions (``path_probs``) come from the two functions below,
shared with the kept-cache draft and with eval's target."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from specdraft.drafting.base import DraftDistributions, Drafter, check_guided
from specdraft.model.decode import draft_batch, draft_rows
from specdraft.model.forward import extend
from specdraft.model.generation import DraftSampling
from specdraft.model.sampling import GREEDY, SamplingParams, sample_from, warp_probs


@torch.inference_mode()
def path_logits(model, context: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """[len(continuation), V] float32 logits: row i predicts the token after ``context + continuation[:i]``.
    One forward over the context and all but the last continuation token."""
    n = len(continuation)
    if n == 0:
        return torch.zeros(0, model.config.vocab_size)
    ids = list(context) + list(continuation)[:-1]
    return extend(model, ids, DynamicCache(config=model.config), 0, logits_to_keep=n)[0].float()


@torch.inference_mode()
def sample_draft(model, context: Sequence[int], num_tokens: int, params: SamplingParams,
                 generator: torch.Generator | None = None) -> DraftDistributions:
    """``num_tokens`` tokens drawn one at a time from ``model``'s warped distribution after ``context`` (a KV
    cache kept within the call), with the distribution of each."""
    cache, ids, rows = DynamicCache(config=model.config), [], []
    logits = extend(model, list(context), cache, 0, logits_to_keep=1)
    for _ in range(num_tokens):
        q = warp_probs(logits[0, -1], params).cpu()  # sampled on the CPU: the generator lives there
        ids.append(int(sample_from(q, generator)))
        rows.append(q)
        if len(ids) < num_tokens:
            logits = extend(model, ids[-1:], cache, len(context) + len(ids) - 1)
    return DraftDistributions.full(ids, torch.stack(rows) if rows else torch.zeros(0, model.config.vocab_size))


class ModelDrafter(Drafter):
    def __init__(self, model, name: str = "model", max_batch_size: int = 32):
        self.model, self.name, self.max_batch_size = model, name, max_batch_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        # Length-sorted chunks keep padding small; results go back in the caller's order.
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        by_index: dict[int, list[int]] = {}
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            for i, row in zip(chunk, draft_batch(self.model, [contexts[i] for i in chunk], num_tokens)):
                by_index[i] = row
        return [by_index[i] for i in range(len(contexts))]

    def draft_with_probs(self, contexts, num_tokens, params, generator=None):
        if params.greedy:  # the greedy draft, bit for bit as ``draft`` gives it
            return super().draft_with_probs(contexts, num_tokens, params, generator)
        return [sample_draft(self.model, c, num_tokens, params, generator) for c in contexts]

    follows_guides = True

    def draft_guided(self, contexts, num_tokens, guides, min_ratios):
        """The server's guided rows (``draft_rows``: each row as alone), ``max_batch_size`` at a time."""
        check_guided(contexts, guides, min_ratios)
        out: list[list[int]] = []
        for start in range(0, len(contexts), self.max_batch_size):
            chunk = range(start, min(len(contexts), start + self.max_batch_size))
            sampling = [DraftSampling(guides=tuple(tuple(g)[:num_tokens] for g in guides[i] if len(g)),
                                      guide_min_ratio=min_ratios[i]) for i in chunk]
            out += [g.tokens for g in draft_rows(self.model, [contexts[i] for i in chunk], num_tokens, sampling)]
        return out

    teacher_forced_paths = True

    def path_probs(self, context, continuation, settings):
        return model_path_probs(self, self.model, context, continuation, settings)


def model_path_probs(drafter: Drafter, model, context: Sequence[int], continuation: Sequence[int],
                     settings: Sequence[SamplingParams]) -> list[DraftDistributions]:
    """A draft model's ``path_probs``: greedy settings get its greedy draft at ``context``, one-hot (what greedy
    speculation drafts, computed as the drafter decodes: a teacher-forced pass may round a near-tie the other way);
    the others its warped distributions along ``continuation`` from one teacher-forced forward."""
    sampled = [params for params in settings if not params.greedy]
    along = iter(teacher_forced(model, context, continuation, sampled) if sampled else [])
    greedy = (Drafter.path_probs(drafter, context, continuation, [GREEDY])[0]
              if len(sampled) < len(settings) else None)
    return [greedy if params.greedy else next(along) for params in settings]


def teacher_forced(model, context: Sequence[int], continuation: Sequence[int],
                   settings: Sequence[SamplingParams]) -> list[DraftDistributions]:
    """A model's q at every prefix of ``continuation`` under each of ``settings`` (``ids``: its most likely token
    there), from one forward."""
    logits = path_logits(model, context, continuation)
    ids = logits.argmax(-1).tolist()
    return [DraftDistributions.full(ids, warp_probs(logits, params)) for params in settings]
