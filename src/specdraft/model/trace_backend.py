"""The target as `specdraft traces` and `specdraft validation` decode with it: token ids in, each prompt's greedy
continuation out, whatever engine runs it.

``TraceBackend`` is what those stages use and all they use: ``name``, ``supports_top_logprobs``, ``generate``,
``info`` and ``close``. ``HFBackend`` is specdraft's own decode loop (``model.decode.iter_greedy``, CPU or GPU);
``model.trace_vllm.VLLMBackend`` is vLLM's offline engine (GPU). Another engine -- llama.cpp decoding many prompts
at once through llama-cpp-python's batch API, say -- is one more subclass: it yields each prompt's greedy tokens
(and, when it can, the top-K log-probabilities at every position) as the prompt finishes, and the stages append,
flush and resume from what it yielded (``append_generations``: one row per prompt, as traces and conversations
write them).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from specdraft.core.io import jsonl_line
from specdraft.core.stage import Progress
from specdraft.model.decode import iter_greedy
from specdraft.model.device import resolve_device
from specdraft.model.forward import eos_token_ids
from specdraft.model.generation import Generation
from specdraft.model.specs import load_model


class TraceBackend(ABC):
    """An engine that decodes the target greedily over many prompts; each attribute's default is what a backend
    without it means. A backend the stage builds it also closes; one passed in, its caller does."""

    name: str = "backend"  # what the log and the summary call it: the ``--backend`` choice that builds it
    # True where ``generate`` can return the K most likely ids and their log-probabilities at every completion
    # position (``traces --top-logprobs K``); a backend without asks for none
    supports_top_logprobs: bool = False

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 top_logprobs: int = 0) -> Iterator[tuple[int, Generation]]:
        """Every prompt's greedy continuation (float32: the traces are the draft's training targets), yielded as
        ``(index into prompts, Generation)`` the moment the prompt is done, each index once, in any order.

        A ``Generation`` holds at most ``max_new_tokens`` tokens and ends with the EOS token when it stopped there
        (``finish_reason`` "eos", else "length"). With ``top_logprobs`` K > 0 (only where
        ``supports_top_logprobs``), it also holds the K most likely ids at every position (the greedy token
        first) and their log-softmax values. The stage writes each result as it comes, so a killed run keeps
        every prompt yielded before the kill and decodes only the others again."""

    def info(self) -> dict[str, Any]:
        """What a run's summary records of the engine (``this_run``): its name, and whatever settings or versions
        decide its speed or its numbers."""
        return {"backend": self.name}

    def close(self) -> None:
        """Free what the engine holds (a model, a llama.cpp context, worker processes); nothing by default."""

    def __enter__(self) -> "TraceBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HFBackend(TraceBackend):
    """specdraft's own decode loop: continuous batching over a static KV cache, longest prompts first."""

    name = "hf"
    supports_top_logprobs = True  # the slot engine's; iter_greedy refuses them on the dynamic engine

    def __init__(self, spec: str, device: str, batch_size: int, threads: int = 0):
        self.device = resolve_device(device)
        if threads and torch.device(self.device).type == "cpu":
            # torch's threads are the process's; one-thread shards, one per core, decode the most per CPU-second
            torch.set_num_threads(threads)
        self.model = load_model(spec, device=self.device)  # float32: traces define the training targets
        self.batch_size = batch_size

    def eos_ids(self) -> set[int]:
        return eos_token_ids(self.model)

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "device": self.device, "dtype": str(next(self.model.parameters()).dtype),
                "batch_size": self.batch_size, "torch_threads": torch.get_num_threads()}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 top_logprobs: int = 0) -> Iterator[tuple[int, Generation]]:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        yield from iter_greedy(self.model, prompts, max_new_tokens, batch_size=self.batch_size, order=order,
                               top_logprobs=top_logprobs)


def append_generations(backend: TraceBackend, out: Path, prompts: list[list[int]], max_new_tokens: int,
                       row: Callable[[int, Generation], dict[str, Any]], desc: str,
                       top_logprobs: int = 0) -> dict[str, Any]:
    """Decode ``prompts``, appending ``row(index, generation)`` to the JSONL file ``out`` and flushing it as each
    prompt finishes (a killed run loses only the rows in flight); this run's record (counts, speed, the backend's
    info). Raises unless the backend returned every prompt."""
    progress = Progress(len(prompts), desc)
    with open(out, "a", encoding="utf-8") as f:
        for i, gen in backend.generate(prompts, max_new_tokens, top_logprobs=top_logprobs):
            f.write(jsonl_line(row(i, gen)) + "\n")
            f.flush()
            progress.update(len(prompts[i]), len(gen.tokens))
        os.fsync(f.fileno())
    this_run = {**progress.close(), **backend.info()}
    if this_run["prompts"] != len(prompts):
        raise RuntimeError(f"backend returned {this_run['prompts']} of {len(prompts)} prompts")
    return this_run
