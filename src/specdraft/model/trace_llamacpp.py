"""llama.cpp as a trace backend (``traces --backend llama.cpp``): the target's GGUF file, decoded greedily over many
prompts at once through llama-cpp-python's batch API.

The continuations are the GGUF file as llama.cpp computes it -- its quantised weights times 8-bit quantised
activations, llama.cpp's kernels -- which is the target a CPU user runs, not the float32 model that transformers
dequantises from the same file (the ``hf`` backend's). One llama.cpp context holds ``sequences`` sequences, each
with KV cells of its own (``kv_unified`` off); a ``llama_decode`` call either feeds every live sequence its last
token (one decode step for all) or prefills one prompt, in pieces of ``batch_tokens`` from its start. When a
sequence ends, its cells are cleared and the next prompt starts in its place (continuous refill). A prompt is
prefilled as llama.cpp prefills it alone and a step computes each row's logits row by row, its attention reading
only its own cells, so a prompt gets bit for bit the tokens llama.cpp's plain decoding gives it alone (tested).

llama-cpp-python is imported only when a backend is built (``model.llamacpp.llama_cpp_module``): an optional extra.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from specdraft.core.io import read_json, sha256_file
from specdraft.model.generation import Generation, top_logprobs_of
from specdraft.model.llamacpp import (
    check_gguf_file,
    llama_cpp_module,
    llama_cpp_version,
    load_gguf_model,
    logits_row,
    sequences_context,
    set_batch_token,
)
from specdraft.model.llamacpp_check import engine_problem
from specdraft.model.specs import CONVERSION_RECORD, ModelSpecError, embedded_gguf_path
from specdraft.model.trace_backend import TraceBackend

COMPUTES = ("the target's GGUF file as llama.cpp computes it (quantised weights, 8-bit quantised activations, "
            "llama.cpp's CPU kernels), not the float32 model transformers dequantises from it")


def target_gguf(spec: str | os.PathLike) -> Path:
    """The GGUF file a target spec points at: an embedded target's own file, or the file a directory converted from
    a GGUF file records (``specdraft_conversion.json``, its sha256 checked); else ValueError saying so."""
    spec = str(spec)
    if spec.startswith("embedded:"):
        return embedded_gguf_path(spec.removeprefix("embedded:"))
    record = Path(spec) / CONVERSION_RECORD
    if record.is_file():
        recorded = read_json(record)
        gguf = Path(recorded.get("gguf_path") or "")
        if not gguf.is_file():
            raise ModelSpecError(f"{record}: its GGUF file {str(gguf)!r} is not on this machine")
        if sha256_file(gguf) != recorded.get("gguf_sha256"):
            raise ModelSpecError(f"{gguf}: not the file {spec} was converted from (sha256 differs from {record})")
        return check_gguf_file(gguf)
    raise ModelSpecError(f"target {spec!r} has no GGUF file for --backend llama.cpp: only an embedded target "
                         f"(embedded:NAME) or a directory converted from one ({CONVERSION_RECORD}) brings one; "
                         "use --backend hf")


@dataclass
class _Row:
    """One prompt in a sequence slot: how much of it the KV cells hold, and what it has generated."""

    index: int
    prompt: list[int]
    fed: int = 0  # prompt tokens already decoded into the sequence's cells
    tokens: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    @property
    def prefilled(self) -> bool:
        return self.fed == len(self.prompt)


class LlamaCppBackend(TraceBackend):
    """A GGUF file in llama.cpp, ``sequences`` prompts decoding at once (finished ones replaced by waiting
    prompts, longest first), ``threads`` CPU threads; at most ``batch_tokens`` tokens per ``llama_decode``: a
    longer prompt is prefilled in pieces of that many (``LlamaCppModel``'s ``n_batch``, which speculate's plain
    decoding uses, by default)."""

    name = "llama.cpp"
    supports_top_logprobs = True  # log-softmax of the logits the greedy choice is made from

    def __init__(self, gguf: str | os.PathLike, sequences: int = 32, threads: int | None = None,
                 batch_tokens: int = 512):
        problem = engine_problem()  # in a child first: an engine that dies of an instruction would take us along
        if problem:
            raise RuntimeError(problem)
        lib = self.lib = llama_cpp_module()
        self.path = check_gguf_file(gguf)
        if not 1 <= sequences <= lib.llama_max_parallel_sequences():
            raise ValueError(f"sequences {sequences}: llama.cpp holds 1 to {lib.llama_max_parallel_sequences()}")
        self.sequences, self.threads = sequences, threads or os.cpu_count() or 1
        self.batch_tokens = max(batch_tokens, sequences)  # every live sequence's next token fits one call
        self.model = load_gguf_model(self.path)
        vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = lib.llama_vocab_n_tokens(vocab)
        # the GGUF's end of sequence and end of turn (-1 where the file has none)
        self.eos = frozenset(t for t in (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)) if t >= 0)
        self.gguf_sha256 = sha256_file(self.path)
        self.batch = lib.llama_batch_init(self.batch_tokens, 0, 1)
        self.ctx = None
        self.n_seq = self.n_ctx_seq = 0

    def eos_ids(self) -> set[int]:
        return set(self.eos)

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "engine": "llama.cpp", "llama_cpp_python": llama_cpp_version(),
                "gguf": str(self.path), "gguf_sha256": self.gguf_sha256, "computes": COMPUTES,
                "sequences": self.sequences, "batch_tokens": self.batch_tokens, "threads": self.threads,
                "n_ctx": self.lib.llama_n_ctx(self.ctx) if self.ctx else None, "n_ctx_per_sequence": self.n_ctx_seq,
                "flash_attn": True, "eos_ids": sorted(self.eos)}

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 top_logprobs: int = 0) -> Iterator[tuple[int, Generation]]:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 0 <= top_logprobs <= self.vocab_size:
            raise ValueError(f"top_logprobs {top_logprobs}: 0 to the vocabulary's {self.vocab_size}")
        if not prompts:
            return
        prompts = [[int(t) for t in p] for p in prompts]
        bad = next((t for p in prompts for t in p if not 0 <= t < self.vocab_size), None)
        if any(not p for p in prompts) or bad is not None:
            raise ValueError(f"every prompt needs tokens, each in 0..{self.vocab_size - 1} ({self.path.name}'s "
                             f"vocabulary){f'; found {bad}' if bad is not None else ''}")
        slots = min(self.sequences, len(prompts))
        self._open_context(slots, max(map(len, prompts)) + max_new_tokens)
        waiting = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))  # longest first, as hf
        rows: list[_Row | None] = [None] * slots
        while waiting or any(rows):
            for seq in range(slots):
                if rows[seq] is None and waiting:
                    i = waiting.popleft()
                    rows[seq] = _Row(i, prompts[i])
            outputs = self._fill_batch(rows)
            code = self.lib.llama_decode(self.ctx, self.batch)
            if code != 0:
                raise RuntimeError(f"{self.path.name}: llama_decode returned {code}")
            for seq, done in self._take_tokens(rows, outputs, max_new_tokens, top_logprobs):
                row = rows[seq]
                rows[seq] = None
                self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), seq, -1, -1)  # for the next
                yield row.index, Generation(row.tokens, done, row.top_ids if top_logprobs else None,
                                            row.top_logprobs if top_logprobs else None)

    def _open_context(self, sequences: int, capacity: int) -> None:
        """A context of ``sequences`` sequences of at least ``capacity`` cells each, empty: this one when it
        is large enough, else a new one."""
        lib = self.lib
        if self.ctx and self.n_seq >= sequences and self.n_ctx_seq >= capacity:
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
            return
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = None
        self.ctx, self.n_ctx_seq = sequences_context(self.model, sequences, capacity, self.batch_tokens,
                                                     self.threads, self.path.name)
        self.n_seq = sequences

    def _fill_batch(self, rows: list[_Row | None]) -> list[tuple[int, int]]:
        """The next ``llama_decode`` batch: the next piece of a prompt being prefilled, alone, else every live
        row's last token. The (slot, batch index) pairs whose logits it asks for.

        A prompt is prefilled on its own, in pieces of ``batch_tokens`` from its start, as llama.cpp decodes it
        alone: with flash attention, the logits depend on how a prompt's tokens are split into passes (two prompts
        in one batch are split into equal pieces), while a one-token step per sequence is the same in any batch."""
        batch, outputs = self.batch, []
        prefilling = next(((seq, row) for seq, row in enumerate(rows) if row is not None and not row.prefilled), None)
        if prefilling is not None:
            seq, row = prefilling
            stop = min(row.fed + self.batch_tokens, len(row.prompt))
            entries = [(row.prompt[pos], pos, seq, pos == len(row.prompt) - 1) for pos in range(row.fed, stop)]
            row.fed = stop
        else:
            entries = [(row.tokens[-1], len(row.prompt) + len(row.tokens) - 1, seq, True)
                       for seq, row in enumerate(rows) if row is not None]
        for n, (token, pos, seq, logits) in enumerate(entries):
            set_batch_token(batch, n, token, pos, seq, logits)
            if logits:
                outputs.append((seq, n))
        batch.n_tokens = len(entries)
        return outputs

    def _take_tokens(self, rows: list[_Row | None], outputs: list[tuple[int, int]], max_new_tokens: int,
                     top_logprobs: int) -> list[tuple[int, str]]:
        """Each output row's greedy token (and top-K) appended to its row; the (slot, finish reason) of the rows
        that are done."""
        if not outputs:
            return []
        # [n, V], a copy: the next decode reuses llama.cpp's buffer
        logits = np.stack([logits_row(self.ctx, i, self.vocab_size) for _, i in outputs])
        greedy = logits.argmax(-1).tolist()
        tops = top_logprobs_of(torch.from_numpy(logits), top_logprobs) if top_logprobs else None
        done = []
        for k, ((seq, _), token) in enumerate(zip(outputs, greedy)):
            row = rows[seq]
            row.tokens.append(token)
            if tops is not None:
                ids, values = tops[0][k], tops[1][k]
                if ids[0] != token:  # an exact tie at the top: the argmax leads, as the records promise
                    if token in ids:
                        ids.remove(token)
                    else:  # more than K tokens tie: all K values are the top one's
                        ids.pop()
                    ids.insert(0, token)
                row.top_ids.append(ids)
                row.top_logprobs.append(values)
            if token in self.eos:
                done.append((seq, "eos"))
            elif len(row.tokens) >= max_new_tokens:
                done.append((seq, "length"))
        return done
