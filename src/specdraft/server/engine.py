"""The model side of the server: a loaded draft (``load_engine``) and the lanes the scheduler runs it in.

Loading is ``model.loader.load_draft``; the compute formats are ``quant.linear``'s. A ``SlotLane`` is a
``model.slot_engine.SlotDecoder`` over the draft whose rows are keyed by request: every row attends to its own
columns only and the int4 kernel computes rows independently, so a request gets the tokens it gets alone, whoever
shares its iteration -- a sampled request too, drawing from its own seeded generator. With a prefix cache
(``model.prefix_cache``, one for both lanes) a lane prefills in blocks and copies in the cached prefix of a context:
the same bits with or without a hit. The server adds the lean decode forward (``model.lean``, built at load) and
hands freed memory back to the OS (``heap_trimming``).

With ``--engine llama.cpp`` the draft's GGUF export is served instead (``load_llamacpp_engine``, the file checked
against its export record): a ``SlotLane`` is then a ``model.llamacpp_slots.LlamaCppSlots``, one llama.cpp sequence
per row, finished rows' sequences kept as sessions and reused token for token.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from torch import nn

from specdraft.core.io import read_json, sha256_file
from specdraft.model.decode import draft_batch, draft_rows
from specdraft.model.export import GGUF_RECORD_SUFFIX
from specdraft.model.generation import DraftSampling, Generation, RowSampler
from specdraft.model.lean import lean_forward, lean_unsupported
from specdraft.model.llamacpp import (
    check_gguf_file,
    exact_pass_tokens,
    llama_cpp_module,
    llama_cpp_version,
    load_gguf_model,
)
from specdraft.model.llamacpp_check import engine_problem
from specdraft.model.llamacpp_slots import LlamaCppSlots, SessionCache
from specdraft.model.loader import load_draft, packed_weight_file
from specdraft.model.prefix_cache import PrefixCache, PrefixCacheStats
from specdraft.model.slot_engine import SlotDecoder
from specdraft.model.specs import architecture_facts
from specdraft.quant.compute_choice import SERVE_WORKLOAD, ComputeSetting, cpu_features
from specdraft.quant.linear import Int4Prefill
from specdraft.server.scheduler import Draft, Lane

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- engine

@runtime_checkable
class DraftEngine(Protocol):
    """What the HTTP layer uses of a loaded draft: its facts for the request schema and ``/health``, and the
    lanes its scheduler runs. ``Engine`` is the real one; the tests' fakes declare the same."""

    name: str  # the model name returned in responses
    compute: str  # the compute format its linear layers run in
    compute_choice: dict[str, Any]  # that format and why: given, or measured at load (``/health`` shows it)
    vocab_size: int
    max_positions: int | None  # the model's positions (None: its config does not say)

    def prefix_cache(self, block_tokens: int, budget_bytes: int) -> PrefixStore:
        """The prefix cache its lanes share, of ``budget_bytes`` in blocks of ``block_tokens``."""

    def close(self) -> None:
        """Free what the engine holds outside Python's reach, once its lanes are done (the server's stop)."""

    def lane(self, slots: int, capacity: int, num_draft: int, prefix_cache: Any = None) -> Lane:
        """``slots`` rows decoding together, each holding ``capacity`` tokens (context + ``num_draft``), reusing
        what ``prefix_cache`` (this engine's own) holds (None: every context prefilled whole)."""


class PrefixStore(Protocol):
    """What the server reads of an engine's prefix cache: its block size and its figures (``/health``, ``/metrics``)."""

    block_tokens: int

    def stats(self) -> PrefixCacheStats: ...


@dataclass
class Engine:
    """A loaded draft model and what the HTTP layer needs to know about it (a ``DraftEngine``)."""

    model: nn.Module
    name: str
    compute: str
    vocab_size: int
    max_positions: int | None
    weights: str | None
    load_info: dict[str, Any] = field(default_factory=dict)
    lean: bool = True  # decode steps through specdraft.model.lean where the model allows it
    # the compute format and why (``model.loader.resolve_compute``: given, or measured at load)
    compute_choice: dict[str, Any] = field(default_factory=dict)

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return draft_batch(self.model, contexts, num_tokens, lean=self.lean)

    def sample(self, contexts: Sequence[Sequence[int]], num_tokens: int,
               sampling: Sequence[DraftSampling]) -> list[Generation]:
        """Drafts with per-row settings and probabilities, as the server's lanes decode them."""
        return draft_rows(self.model, contexts, num_tokens, sampling, lean=self.lean)

    def prefix_cache(self, block_tokens: int, budget_bytes: int) -> PrefixCache:
        return PrefixCache(block_tokens, budget_bytes)

    def close(self) -> None:
        pass  # torch frees the model with its last reference

    def lane(self, slots: int, capacity: int, num_draft: int, prefix_cache: PrefixCache | None = None) -> "SlotLane":
        return torch_lane(self.model, slots, capacity, num_draft, lean=self.lean, prefix_cache=prefix_cache)

    def bytes_per_token(self) -> int:
        """Weight bytes one decode step reads at batch 1 (linear layers; the embedding row is negligible)."""
        return int(self.load_info.get("linear_weight_bytes", 0))


class SlotLane:
    """Rows of one decoder (``SlotDecoder``, or ``LlamaCppSlots``: exact rows), keyed by the scheduler's request
    keys."""

    def __init__(self, decoder: SlotDecoder | LlamaCppSlots, slots: int, capacity: int, block_tokens: int):
        self.decoder = decoder
        self.slots, self.capacity, self.block_tokens = slots, capacity, block_tokens

    @property
    def free(self) -> int:
        return self.decoder.free

    def cached(self, context: Sequence[int]) -> int:
        return self.decoder.reusable(context)

    def _drafts(self, finished: list[tuple[int, Generation]]) -> dict[int, Draft]:
        d = self.decoder
        out = {key: _draft_so_far(toks, sampler) for key, toks, sampler in zip(d.index, d.tokens, d.samplers)}
        out.update({key: Draft(gen.tokens, gen.probs, gen.alternative_ids, gen.alternative_probs,
                               stopped=gen.finish_reason == "confidence")
                    for key, gen in finished})
        return out

    def admit(self, keys: Sequence[int], contexts: Sequence[Sequence[int]],
              sampling: Sequence[DraftSampling]) -> dict[int, Draft]:
        drafts = self._drafts(self.decoder.admit(list(keys), list(contexts), list(sampling)))
        return {key: drafts[key] for key in keys}

    def prefill_chunk(self, key: int, context: Sequence[int], start: int, size: int,
                      sampling: DraftSampling) -> dict[int, Draft]:
        finished = self.decoder.prefill_chunk(key, context, start, size, sampling)
        if start + size < len(context):
            return {}
        return {key: self._drafts(finished)[key]}

    def step(self) -> dict[int, Draft]:
        return self._drafts(self.decoder.step())

    def release(self, keys: Sequence[int]) -> None:
        self.decoder.release(keys)

    def close(self) -> None:
        """Free what the rows hold outside Python (a llama.cpp context); the lane is not used after it."""
        self.decoder.close()


def torch_lane(model: nn.Module, slots: int, capacity: int, num_draft: int, lean: bool = True,
               prefix_cache: PrefixCache | None = None) -> SlotLane:
    """A lane of ``slots`` rows of the torch ``model`` (``SlotDecoder``, each row computed as alone)."""
    decoder = SlotDecoder(model, slots, capacity, num_draft, eos=set(), lean=lean, row_attention=True,
                          prefix_cache=prefix_cache)
    return SlotLane(decoder, slots, capacity, 0 if prefix_cache is None else prefix_cache.block_tokens)


def _draft_so_far(tokens: list[int], sampler: RowSampler | None) -> Draft:
    if sampler is None:
        return Draft(list(tokens))
    report = sampler.report()
    return Draft(list(tokens), report["probs"], report["alternative_ids"], report["alternative_probs"])


def heap_trimmer() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (frees every unused heap page back to the OS), or None without glibc.

    Each draft step allocates KV caches and activations sized by its batch and context lengths; glibc keeps
    the freed chunks as a high-water mark, so the RSS would climb with every new shape (bench/bench_memory.py
    measures both).
    """

    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols (libc is loaded): ctypes.util.find_library would spawn ldconfig, and the
        # audit's sandbox rightly counts a server that starts processes as a failure.
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def heap_trimming(enabled: bool) -> Callable[[], None] | None:
    """What the worker calls after each iteration to hand freed memory back to the OS (at most once a second)."""
    if not enabled:
        return None
    trim = heap_trimmer()
    if trim is None:
        log.info("trim_heap: no glibc malloc_trim here; freed memory stays with the allocator")
        return None
    trim()  # loading freed the float32 model it started from: memory glibc would otherwise keep
    return every(1.0, trim)


def every(seconds: float, fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` at most once per ``seconds``, however often the returned function is called."""
    last = [0.0]

    def run() -> None:
        now = time.monotonic()
        if now - last[0] >= seconds:
            last[0] = now
            fn()
    return run


def load_engine(model_dir: str | os.PathLike, weights: str | os.PathLike | None, compute: ComputeSetting,
                name: str | None = None, prefill: Int4Prefill = "bfloat16", lean: bool = True,
                device: str = "cpu") -> Engine:
    """The draft for serving (``model.loader.load_draft``; ``auto`` measured on the server's workload), its decode
    steps' lean forward built now (q/k/v fused once) so that the first request does not pay for it."""
    model, source = load_draft(model_dir, compute, weights=weights, prefill=prefill, device=device,
                               workload=SERVE_WORKLOAD, row_invariant=True)
    summary = source["compute_summary"]
    lean_reason = ("off (--no-lean)" if not lean else
                   f"off: {lean_unsupported(model)}" if lean_forward(model) is None else "on")
    info = {**source.get("load_info", {}), **summary, "lean_forward": lean_reason, "seconds": source["seconds"],
            "device": source["device"]}
    facts = architecture_facts(model.config)
    log.info("draft ready on %s: compute=%s (prefill %s; %s), %d linear layers from QD04 codes, %d quantised at "
             "load, %.1f MB of linear weights per token, lean decode %s, %.2fs", source["device"], summary["compute"],
             summary["prefill"], source["compute_choice"]["reason"], summary["from_codes"],
             summary["quantised_at_load"], summary["linear_weight_bytes"] / 1e6, lean_reason, source["seconds"])
    return Engine(model=model, name=name or Path(model_dir).resolve().name, compute=summary["compute"],
                  vocab_size=int(facts["vocab"]), max_positions=facts["max_positions"],
                  weights=source.get("weights"), load_info=info, lean=lean, compute_choice=source["compute_choice"])


# ---------------------------------------------------------------------------------------------- llama.cpp

@dataclass
class LlamaCppEngine:
    """The draft's GGUF export served by llama.cpp (``--engine llama.cpp``): the same ``DraftEngine``, its lanes
    ``model.llamacpp_slots.LlamaCppSlots``. ``close`` frees the model."""

    model: Any  # llama.cpp's model handle
    path: Path
    name: str
    compute: str
    vocab_size: int
    max_positions: int | None
    threads: int
    compute_choice: dict[str, Any] = field(default_factory=dict)
    lanes: list[LlamaCppSlots] = field(default_factory=list)
    # tokens per prefill pass that give one-token passes' bits (``model.llamacpp.exact_pass_tokens``, probed at load)
    pass_tokens: int = 1

    def prefix_cache(self, block_tokens: int, budget_bytes: int) -> SessionCache:
        return SessionCache(budget_bytes)  # token granularity, whatever the block size (model.llamacpp_slots: why)

    def lane(self, slots: int, capacity: int, num_draft: int, prefix_cache: SessionCache | None = None) -> SlotLane:
        if not self.model:
            raise RuntimeError(f"{self.path.name}: the engine is closed")
        decoder = LlamaCppSlots(self.model, slots, capacity, num_draft, eos=set(), vocab_size=self.vocab_size,
                                threads=self.threads, cache=prefix_cache, name=self.path.name,
                                pass_tokens=self.pass_tokens)
        self.lanes.append(decoder)
        return SlotLane(decoder, slots, capacity, 0 if prefix_cache is None else prefix_cache.block_tokens)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        self.lanes.clear()
        if self.model:
            llama_cpp_module().llama_model_free(self.model)
            self.model = None


def gguf_of(model_dir: str | os.PathLike, gguf: str | os.PathLike) -> Path:
    """``gguf``, when its export record (``<file>.export.json``) says it holds the weights of ``model_dir``'s draft;
    else ValueError naming the file and what differs. Nothing is taken from file names."""
    path = check_gguf_file(gguf)
    record_path = path.with_name(path.name + GGUF_RECORD_SUFFIX)
    if not record_path.is_file():
        raise ValueError(f"{path}: no export record {record_path.name} beside it, so nothing says which draft it "
                         f"holds (write it with `specdraft export {model_dir} --format gguf`)")
    record = read_json(record_path)
    weights = packed_weight_file(model_dir)
    if weights is None:
        raise ValueError(f"{model_dir}: no QD04 weight file; --engine llama.cpp serves the GGUF export of a packed "
                         "draft")
    want = sha256_file(weights)
    source = record.get("source", {})
    if source.get("weights_sha256") != want:
        raise ValueError(f"{path}: exported from weights {str(source.get('weights_sha256'))[:12]}... "
                         f"({source.get('model_dir')}), not {weights} ({want[:12]}...): export this draft again")
    if sha256_file(path) != record.get("output", {}).get("sha256"):
        raise ValueError(f"{path}: its sha256 differs from the one {record_path.name} records (changed since export)")
    return path


def load_llamacpp_engine(model_dir: str | os.PathLike, gguf: str | os.PathLike, name: str | None = None,
                         threads: int | None = None) -> LlamaCppEngine:
    """The GGUF export of ``model_dir``'s draft in llama.cpp (checked against its export record), after llama.cpp
    has shown in a child process that it runs on this CPU."""
    started = time.perf_counter()
    path = gguf_of(model_dir, gguf)
    problem = engine_problem()  # in a child first: an engine that dies of an instruction would take us along
    if problem:
        raise RuntimeError(problem)
    lib = llama_cpp_module()
    model = load_gguf_model(path)
    buffer = ctypes.create_string_buffer(256)
    lib.llama_model_desc(model, buffer, len(buffer))
    description = buffer.value.decode(errors="replace")
    threads = threads or max(1, (os.cpu_count() or 2) - 1)
    try:
        pass_tokens = exact_pass_tokens(model, threads)
    except BaseException:
        lib.llama_model_free(model)
        raise
    reason = (f"--engine llama.cpp: {path.name} ({description}) through llama-cpp-python "
              f"{llama_cpp_version()}, {threads} thread(s), prefill passes of {pass_tokens} token(s)")
    log.info("draft ready in llama.cpp: %s, %.2fs", reason, time.perf_counter() - started)
    vocab = lib.llama_model_get_vocab(model)
    return LlamaCppEngine(model=model, path=path, name=name or Path(model_dir).resolve().name,
                          compute=f"llama.cpp {description}", vocab_size=int(lib.llama_vocab_n_tokens(vocab)),
                          max_positions=int(lib.llama_model_n_ctx_train(model)) or None, threads=threads,
                          pass_tokens=pass_tokens,
                          compute_choice={"compute": "llama.cpp", "engine": "llama.cpp", "gguf": str(path),
                                          "model": description, "threads": threads,
                                          "prefill_pass_tokens": pass_tokens, "reason": reason})


def engine_hint() -> str | None:
    """What to tell a user serving through torch on a CPU class where llama.cpp has served a speculation loop cheaper
    (AVX2 and AVX-512 without AMX, llama-cpp-python installed); None elsewhere. AMX is left out: not measured."""
    cpu = cpu_features()
    # find_spec, not an import: loading llama.cpp's libraries into a torch server is not this hint's to do
    if cpu["amx"] or importlib.util.find_spec("llama_cpp") is None:
        return None
    return (f"this CPU runs torch's kernels at {cpu['capability']} without AMX, a class where llama.cpp has served a "
            "speculation loop with less time per token than torch: give the server the draft's GGUF export (--gguf "
            "FILE, from `specdraft export MODEL_DIR --format gguf`) and --engine auto times both engines on a "
            "speculation loop and serves the cheaper (docs/stages/serve.md#the-llamacpp-engine)")
