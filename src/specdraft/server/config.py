"""``ServeConfig``: every setting of `specdraft serve`, defined once (the CLI is built from it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from specdraft.core.config import StageConfig
from specdraft.core.wire import DRAFT_TOKENS, MAX_DRAFT_TOKENS
from specdraft.quant.compute_choice import ComputeSetting
from specdraft.quant.linear import Int4Prefill

# The prefix cache's default budget: this share of the memory available when the server starts, at most the cap
# (a draft's KV is small; the lanes, the model and the rest of the machine keep the remainder)
PREFIX_CACHE_SHARE = 0.125
PREFIX_CACHE_MAX_MB = 1024
PREFIX_CACHE_FALLBACK_MB = 256  # where the available memory cannot be read (no /proc/meminfo)


class ServeConfig(StageConfig):
    model_dir: str = Field(description="draft model dir: a packed dir (config.json + draft.qd4) or a plain HF dir")
    weights: str | None = Field(
        None, description="QD04 weight file, read by the strict QD04 loader (default: MODEL_DIR/draft.qd4 when "
                          "present; from_pretrained on MODEL_DIR only when there is no weight file)")
    engine: Literal["auto", "torch", "llama.cpp"] = Field("auto", description=(
        "what runs the draft: torch (the QD04 pack, in the --compute format), llama.cpp (its GGUF export, --gguf; the "
        "`specdraft[llama]` extra), or auto: given --gguf, both timed on a replayed speculation loop at start and the "
        "cheaper serves (torch on a tie; the log and /health say why), else torch"))
    gguf: str | None = Field(None, description=("with --engine auto or llama.cpp: the GGUF file `specdraft export "
                                                "MODEL_DIR --format gguf` wrote of this draft (its export record is "
                                                "checked)"))
    host: str = Field("127.0.0.1", description="address to bind (loopback by default)")
    port: int = Field(8000, ge=0, le=65535,
                      description="TCP port; 0 picks a free one (the log line 'listening on http://HOST:PORT' "
                                  "names it)")
    max_batch_size: int = Field(32, ge=1, le=1024,
                                description="most short requests decoding together (the short lane's KV slots, "
                                            "preallocated: max_batch_size x (long_context_tokens + num_draft) tokens)")
    max_wait_ms: float = Field(2.0, ge=0, le=10_000,
                               description="how long an idle worker waits for more requests after the first one")
    num_draft: int = Field(DRAFT_TOKENS, ge=1, le=MAX_DRAFT_TOKENS,
                           description="default and largest num_tokens of a request")
    max_context: int | None = Field(
        None, ge=1, description="longest token_ids accepted, 422 beyond (default and upper bound: the model's "
                                "positions minus num_draft)", json_schema_extra={"aliases": ["--max-context-tokens"]})
    long_context_tokens: int = Field(
        512, ge=1, description="contexts longer than this go to the long lane: prefilled in chunks between the "
                               "short requests' decode steps, one long prefill at a time")
    long_slots: int = Field(1, ge=1, le=64, description="long requests decoding together (the long lane's KV slots, "
                                                        "each max_context + num_draft tokens, preallocated)")
    prefill_tokens: int = Field(
        512, ge=1, description="context tokens prefilled per scheduler iteration, between decode steps (short "
                               "contexts whole, a long one in chunks)",
        json_schema_extra={"aliases": ["--max-batch-tokens"]})
    prefill_chunk_tokens: int = Field(
        64, ge=1, description="a long prefill's chunk while short work runs, until the costs are measured; then the "
                              "chunk takes at most --long-share of the worker's time")
    long_share: float = Field(0.25, gt=0, lt=1, description="most of the worker's time long prefills take while "
                                                            "short requests wait or run")
    device: str = Field("auto", description="torch device: auto (cuda when available, else cpu), cpu, cuda or "
                                            "cuda:N; int4 off the CPU runs in bfloat16")
    threads: int | None = Field(None, ge=1, le=256,
                                description="torch intra-op threads (default: CPUs - 1, leaving one core to the "
                                            "HTTP side; at least 1)")
    compute: ComputeSetting = Field(
        "auto", description="format of the linear layers: auto times float32, bfloat16 and int4 (with a bf16, "
                            "float32 or int4 prefill) on the draft's own shapes at load, for the "
                            "server's work (contexts of 64 to 1,024 tokens, 1 to 4 requests decoding together), and "
                            "serves the fastest on this CPU (the log and /health say what it picked and why); or "
                            "float32, bfloat16, or int4 (the QD04 4-bit codes run by torch's CPU int4 kernel in "
                            "decode steps)")
    int4_prefill: Int4Prefill = Field(
        "bfloat16", description="with --compute int4: what the prefill of the contexts runs on, a dense bfloat16 or "
                                "float32 copy of the layer weights (faster than the int4 kernel at many rows), or the "
                                "int4 codes; decode steps stay on the 4-bit codes (auto chooses this too)")
    lean: bool = Field(
        True, description="run decode steps through specdraft's written-out Llama/Qwen forward (specdraft.model.lean: "
                          "the same logits bit for bit, q/k/v in one int4 call, less per-call overhead); off, or "
                          "for other architectures, transformers' own forward")
    trim_heap: bool = Field(
        True, description="hand freed memory back to the OS after model work (glibc malloc_trim): batches "
                          "of varying shapes otherwise leave the heap fragmented and the RSS climbing; "
                          "no-op without glibc")
    max_queue: int = Field(256, ge=1, le=1_000_000,
                           description="requests that may wait for the worker; beyond it: 503 + Retry-After")
    max_body_bytes: int = Field(1 << 20, ge=256, description="largest request body accepted (413 beyond)")
    request_timeout_s: float = Field(30.0, gt=0, description="a request not answered by then gets 503 (and is "
                                                            "dropped); one the work ahead cannot answer by then is "
                                                            "refused at once with 503 + Retry-After")
    shutdown_timeout_s: float = Field(10.0, gt=0, description="on SIGINT/SIGTERM: how long requests in flight may "
                                                              "still be answered before the rest get 503 and the "
                                                              "server exits")
    model_name: str | None = Field(None, description="name returned in responses (default: the model dir's name)")
    prefix_cache_mb: int | None = Field(
        None, ge=0, description="memory budget of the prefix cache, in MiB: the keys and values of recent contexts, "
                                "in whole blocks, so a request that extends an earlier context (a speculation loop) "
                                "computes only what is new; least recently used blocks go first (default: 1/8 of "
                                "the memory available at start, at most 1024; 0: no cache, every context "
                                "prefilled whole)")
    prefix_block_tokens: int = Field(
        32, ge=1, le=512, description="with the prefix cache: contexts are prefilled in blocks of this many tokens "
                                      "and reused in whole blocks (smaller: less recomputed after a hit, more "
                                      "model calls on a miss)")

    @model_validator(mode="after")
    def _gguf_with_llamacpp(self) -> "ServeConfig":
        if self.engine == "llama.cpp" and self.gguf is None:
            raise ValueError("--engine llama.cpp serves a GGUF file: give --gguf with it")
        if self.engine == "torch" and self.gguf is not None:
            raise ValueError("--engine torch serves the QD04 pack: --gguf is for --engine llama.cpp or auto")
        return self

    def prefix_cache_bytes(self) -> int:
        """The prefix cache's budget: --prefix-cache-mb, or by default a share of the memory available now."""
        if self.prefix_cache_mb is not None:
            return self.prefix_cache_mb << 20
        available = _available_bytes()
        if available is None:
            return PREFIX_CACHE_FALLBACK_MB << 20
        return min(int(available * PREFIX_CACHE_SHARE), PREFIX_CACHE_MAX_MB << 20)


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        return None
    return None
