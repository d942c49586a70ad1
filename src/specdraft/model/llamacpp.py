"""llama.cpp, the CPU engine users run, through llama-cpp-python (the optional extra ``specdraft[llama]``).

``LlamaCppModel`` is one GGUF file with one sequence's KV cache, driven through llama.cpp's C API: a batch of
tokens at given positions, logits only where they are needed (one row for a plain step, k + 1 for a verify
pass), the cache cut back to the tokens kept. ``LlamaCppTarget`` is that model as speculative decoding's
target. ``requantize`` is llama.cpp's ``llama-quantize`` (full-precision targets from a quantised file);
``vocab_compatible`` is the draft/target vocabulary check llama.cpp runs before it speculates.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specdraft.core.io import atomic_file
from specdraft.model.targets import TargetModel

INSTALL_HINT = "pip install 'specdraft[llama]' (llama-cpp-python, which builds llama.cpp)"
GGUF_MAGIC = b"GGUF"
# the llama_ftype values of llama.h that requantize takes, by name
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
CTX_PAD = 256  # llama.cpp pads a sequence's cells to a multiple of this
# prefill pass sizes ``exact_pass_tokens`` tries, and its probe's length: past the cache lengths at which llama.cpp
# has been seen to compute a one-token pass with other kernels when it has several threads (docs/history.md)
PASS_CANDIDATES = (32, 8)
PROBE_TOKENS = 320


def llama_cpp_module():
    """The llama_cpp package, or an ImportError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(f"the llama.cpp engine needs llama-cpp-python: {INSTALL_HINT} ({e})") from e
    return llama_cpp


def llama_cpp_available() -> bool:
    try:
        llama_cpp_module()
    except ImportError:
        return False
    return True


def llama_cpp_version() -> str | None:
    try:
        return llama_cpp_module().__version__
    except ImportError:
        return None


def check_gguf_file(path: str | os.PathLike) -> Path:
    """The path, when it is a file that starts like a GGUF file; else ValueError naming it and the reason."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})")
    return path


def load_gguf_model(path: str | os.PathLike) -> Any:
    """A GGUF file loaded by llama.cpp's C API (``llama_model_free`` it), quiet as ``Llama(verbose=False)``; else
    ValueError naming the file."""
    lib = llama_cpp_module()
    path = check_gguf_file(path)
    # llama.cpp's load log, quiet as ``Llama(verbose=False)`` makes it (llama-cpp-python's log callback)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    if not model:
        raise ValueError(f"{path}: llama.cpp could not load it")
    return model


def sequences_context(model: Any, sequences: int, capacity: int, batch_tokens: int, threads: int,
                      name: str) -> tuple[Any, int]:
    """A llama.cpp context of ``sequences`` sequences with cells of their own (``kv_unified`` off: a sequence's
    attention never reads another's), each at least ``capacity`` positions, at most ``batch_tokens`` tokens per
    ``llama_decode``, flash attention on; and the positions each sequence gets. RuntimeError or ValueError naming
    ``name`` when llama.cpp cannot make it."""
    lib = llama_cpp_module()
    if not 1 <= sequences <= lib.llama_max_parallel_sequences():
        raise ValueError(f"{name}: {sequences} sequences; llama.cpp holds 1 to {lib.llama_max_parallel_sequences()}")
    params = lib.llama_context_default_params()
    # llama.cpp pads each sequence's cells to a multiple of 256: ask for that, so n_ctx divides evenly
    per_sequence = -(-capacity // CTX_PAD) * CTX_PAD
    params.n_ctx, params.n_seq_max = sequences * per_sequence, sequences
    params.n_batch = params.n_ubatch = batch_tokens
    params.n_threads = params.n_threads_batch = threads
    # flash attention on, as llama.cpp's own tools choose it on a CPU (as ``LlamaCppModel``)
    params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.kv_unified = False
    params.no_perf = True
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"{name}: llama.cpp could not make a context of {sequences} sequences x {capacity} "
                           "positions (memory?)")
    per_sequence = lib.llama_n_ctx_seq(ctx)
    if per_sequence < capacity:
        lib.llama_free(ctx)
        raise ValueError(f"{name}: {capacity} positions per sequence exceed what llama.cpp gives ({per_sequence})")
    return ctx, per_sequence


def set_batch_token(batch: Any, n: int, token: int, position: int, seq: int, logits: bool) -> None:
    """Entry ``n`` of a ``llama_batch``: ``token`` at ``position`` of sequence ``seq``, its logits wanted or not."""
    batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, position, 1, logits
    batch.seq_id[n][0] = seq


def exact_pass_tokens(model: Any, threads: int, candidates: Sequence[int] = PASS_CANDIDATES,
                      probe_tokens: int = PROBE_TOKENS) -> int:
    """The most tokens a pass may carry, of ``candidates``, and still give every position the logits one-token
    passes give it bit for bit, on this model, CPU and thread count (1 when none does). llama.cpp picks its kernels
    by a pass's shape: past a few dozen tokens, or over a few hundred cached positions with several threads, they
    round otherwise. Probed on ``probe_tokens`` fixed tokens, every position's logits compared."""
    lib = llama_cpp_module()
    vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
    tokens = np.random.default_rng(0).integers(0, vocab_size, probe_tokens).tolist()
    most = max(candidates)
    ctx, _ = sequences_context(model, 1, probe_tokens, most, threads, "exact pass probe")
    batch = lib.llama_batch_init(most, 0, 1)
    memory = lib.llama_get_memory(ctx)

    def logits(pass_tokens: int) -> np.ndarray:
        lib.llama_memory_seq_rm(memory, 0, 0, -1)
        rows = []
        for start in range(0, probe_tokens, pass_tokens):
            chunk = tokens[start:start + pass_tokens]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                set_batch_token(batch, i, token, start + i, 0, True)
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"exact pass probe: llama_decode failed on a pass of {len(chunk)} tokens")
            rows += [logits_row(ctx, i, vocab_size).copy() for i in range(len(chunk))]
        return np.stack(rows)

    try:
        one_token = logits(1)
        return next((n for n in sorted(candidates, reverse=True) if np.array_equal(logits(n), one_token)), 1)
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)


def logits_row(ctx: Any, index: int, vocab_size: int) -> np.ndarray:
    """The logits of batch entry ``index`` of the last ``llama_decode``: [vocab], a view of llama.cpp's buffer
    (the next decode overwrites it)."""
    return np.ctypeslib.as_array(llama_cpp_module().llama_get_logits_ith(ctx, index), shape=(vocab_size,))


class LlamaCppModel:
    """A GGUF model in llama.cpp holding one sequence. ``tokens`` mirrors what its KV cache holds."""

    def __init__(self, path: str | os.PathLike, n_ctx: int = 4096, threads: int | None = None,
                 n_batch: int = 512, flash_attn: bool = True):
        lib = llama_cpp_module()
        self.lib, self.path = lib, check_gguf_file(path)
        threads = threads or os.cpu_count() or 1
        try:
            # flash attention on, as llama.cpp's own tools choose it on a CPU ("auto"); llama-cpp-python's
            # default is off, and slower
            self.llm = lib.Llama(str(self.path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                                 n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
        except (ValueError, RuntimeError) as e:  # llama.cpp refused the file (truncated, unknown architecture)
            raise ValueError(f"{self.path}: llama.cpp could not load it ({e})") from e
        self.threads, self.n_ctx, self.n_batch = threads, n_ctx, n_batch
        self.vocab_size = self.llm.n_vocab()
        vocab = lib.llama_model_get_vocab(self.llm.model)
        self.eog_ids = frozenset(t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(vocab, t))
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.memory = lib.llama_get_memory(self.llm.ctx)
        self.tokens: list[int] = []

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):
            self.lib.llama_memory_seq_rm(self.memory, 0, length, -1)
            del self.tokens[length:]

    def decode(self, tokens: Sequence[int], start: int, n_logits: int = 1) -> np.ndarray:
        """Feed ``tokens`` at positions start.. (the cache cut there first); the logits after each of the last
        ``n_logits`` of them, [n_logits, vocab] (a copy)."""
        tokens = [int(t) for t in tokens]
        if not tokens or not 1 <= n_logits <= len(tokens):
            raise ValueError(f"decode: {len(tokens)} tokens, {n_logits} logit rows")
        if start > len(self.tokens):
            raise ValueError(f"decode at position {start}: the cache holds only {len(self.tokens)} positions")
        if start + len(tokens) > self.n_ctx:
            raise ValueError(f"{self.path.name}: {start + len(tokens)} positions exceed the context of {self.n_ctx}")
        self.truncate(start)
        first_logit = len(tokens) - n_logits
        rows = []
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset:offset + self.n_batch]
            batch = self.batch
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                set_batch_token(batch, i, tok, start + offset + i, 0, offset + i >= first_logit)
            code = self.lib.llama_decode(self.llm.ctx, batch)
            if code != 0:
                self.truncate(start)
                raise RuntimeError(f"{self.path.name}: llama_decode returned {code}")
            self.tokens += chunk
            for i in range(max(0, first_logit - offset), len(chunk)):
                ptr = self.lib.llama_get_logits_ith(self.llm.ctx, i)
                rows.append(np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy())
        return np.stack(rows)

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        self.llm.close()


class LlamaCppTarget(TargetModel):
    """A GGUF target in llama.cpp: greedy argmax of its logits. Not ``exact``: llama.cpp computes a pass over
    several tokens with other kernels (and roundings) than a one-token pass, so a verify pass may part from
    plain decoding at a near-tie."""

    engine = "llama.cpp"
    exact = False

    def __init__(self, path: str | os.PathLike, n_ctx: int = 4096, threads: int | None = None, name: str = "target"):
        self.model = LlamaCppModel(path, n_ctx=n_ctx, threads=threads)
        self.name, self.path = name, self.model.path
        self.vocab_size = self.model.vocab_size
        self.eos_ids = self.model.eog_ids

    def prefill(self, prompt: Sequence[int]) -> int:
        self.model.truncate(0)
        return int(self.model.decode(prompt, 0)[-1].argmax())

    def verify(self, tokens: Sequence[int], start: int) -> list[int]:
        return self.model.decode(tokens, start, n_logits=len(tokens)).argmax(-1).tolist()

    def truncate(self, length: int) -> None:
        self.model.truncate(length)

    def close(self) -> None:
        self.model.close()


def batched_against_sequential(model: LlamaCppModel, prompt: Sequence[int], tokens: Sequence[int],
                               pass_tokens: int) -> dict[str, Any]:
    """How far llama.cpp's passes over several tokens stray from its one-token passes on the same tokens: the
    logits after each of ``tokens`` computed one token at a time (plain decoding) and in passes of
    ``pass_tokens`` tokens (verify passes: the last token kept, then the next ones), teacher-forced on ``tokens``,
    both after the same prefill of ``prompt``. Where the argmax differs, speculative decoding's output parts from
    plain greedy; how often that happens is the engine's, not the drafter's."""
    prompt, tokens = [int(t) for t in prompt], [int(t) for t in tokens]
    if not prompt or pass_tokens < 1:
        raise ValueError("need a prompt and passes of at least one token")
    sequential = [model.decode(prompt, 0)[-1]]
    for i, tok in enumerate(tokens[:-1]):
        sequential.append(model.decode([tok], len(prompt) + i)[-1])
    # as speculative decoding runs with every drafted token accepted: the prompt's prefill, then passes over the
    # last token kept and the next ones
    batched = [model.decode(prompt, 0)[-1:]]
    for i in range(0, len(tokens) - 1, pass_tokens):
        chunk = tokens[i:min(i + pass_tokens, len(tokens) - 1)]
        batched.append(model.decode(chunk, len(prompt) + i, n_logits=len(chunk)))
    sequential_arr, batched_arr = np.stack(sequential), np.concatenate(batched)
    top2 = np.sort(sequential_arr, axis=1)[:, -2:]
    differs = sequential_arr.argmax(1) != batched_arr.argmax(1)
    return {"positions": len(tokens), "pass_tokens": pass_tokens, "argmax_differs": int(differs.sum()),
            "max_logit_difference": float(np.abs(sequential_arr - batched_arr).max()),
            "logit_scale": float(np.abs(sequential_arr).max()),
            "top2_gap_where_differs": [round(float(g), 4) for g in (top2[:, 1] - top2[:, 0])[differs]]}


def requantize(source: str | os.PathLike, out: str | os.PathLike, file_type: str = "F32",
               threads: int | None = None) -> Path:
    """``llama-quantize --allow-requantize SOURCE OUT FILE_TYPE`` through the library: e.g. the embedded target's
    Q4_1 file at F32, a full-precision target of the same weights."""
    lib = llama_cpp_module()
    if file_type not in FILE_TYPES:
        raise ValueError(f"file type {file_type!r}: one of {sorted(FILE_TYPES)}")
    source, out = check_gguf_file(source), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    params = lib.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.allow_requantize = True
    params.nthread = threads or os.cpu_count() or 1
    with atomic_file(out) as partial:
        code = lib.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
        if code != 0:
            raise RuntimeError(f"llama_model_quantize {source} -> {file_type} returned {code}")
    return out


def vocab_compatible(target: str | os.PathLike, draft: str | os.PathLike) -> dict[str, Any]:
    """llama.cpp's ``common_speculative_are_compatible`` (common/speculative.cpp) through its C API: the facts it
    compares and its verdict."""
    lib = llama_cpp_module()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    models = [lib.llama_model_load_from_file(str(check_gguf_file(p)).encode(), params) for p in (target, draft)]
    try:
        if not all(models):
            raise ValueError(f"llama.cpp could not read the vocabulary of {target} or {draft}")
        t, d = (lib.llama_model_get_vocab(m) for m in models)
        n_t, n_d = lib.llama_vocab_n_tokens(t), lib.llama_vocab_n_tokens(d)
        text = lib.llama_vocab_get_text
        differ = [i for i in range(5, min(n_t, n_d)) if text(t, i) != text(d, i)]
        out = {"vocab_type": [lib.llama_vocab_type(t), lib.llama_vocab_type(d)],
               "add_bos": [lib.llama_vocab_get_add_bos(t), lib.llama_vocab_get_add_bos(d)],
               "bos": [lib.llama_vocab_bos(t), lib.llama_vocab_bos(d)],
               "add_eos": [lib.llama_vocab_get_add_eos(t), lib.llama_vocab_get_add_eos(d)],
               "eos": [lib.llama_vocab_eos(t), lib.llama_vocab_eos(d)], "n_tokens": [n_t, n_d],
               "token_texts_differing": len(differ)}
    finally:
        for m in models:
            if m:
                lib.llama_model_free(m)
    out["compatible"] = (out["vocab_type"][0] == out["vocab_type"][1] and out["add_bos"][0] == out["add_bos"][1]
                         and (not out["add_bos"][0] or out["bos"][0] == out["bos"][1])
                         and out["add_eos"][0] == out["add_eos"][1]
                         and (not out["add_eos"][0] or out["eos"][0] == out["eos"][1])
                         and abs(n_t - n_d) <= 128 and not differ)
    return out


def vocab_texts(path: str | os.PathLike) -> list[bytes]:
    """Every token's text in a GGUF file's vocabulary as llama.cpp reads it (``llama_vocab_get_text``)."""
    lib = llama_cpp_module()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(check_gguf_file(path)).encode(), params)
    if not model:
        raise ValueError(f"{path}: llama.cpp could not read its vocabulary")
    try:
        vocab = lib.llama_model_get_vocab(model)
        return [lib.llama_vocab_get_text(vocab, i) for i in range(lib.llama_vocab_n_tokens(vocab))]
    finally:
        lib.llama_model_free(model)
