"""vLLM's offline engine as a trace backend (``traces --backend vllm``): token ids in, token ids out; greedy
(temperature 0), float32, with tensor parallelism inside one process. vllm is imported only when this backend
is built: an optional, heavy, GPU-only dependency that pins its own torch (the tests pass a fake module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

from specdraft.core.io import read_json
from specdraft.model.generation import Generation
from specdraft.model.specs import load_tokenizer, resolve_model
from specdraft.model.trace_backend import TraceBackend


class VLLMBackend(TraceBackend):
    """vLLM's offline engine: token ids in, token ids out; greedy (temperature 0), float32."""

    name = "vllm"

    def __init__(self, spec: str, tensor_parallel_size: int, chunk: int, llm: Any = None, vllm_module: Any = None):
        path = resolve_model(spec)
        if vllm_module is None:
            try:  # here, not at the top: an optional, heavy, GPU-only dependency that pins its own torch
                import vllm as vllm_module  # noqa: F811
            except ImportError as e:
                raise ValueError("backend 'vllm' needs the vllm package (pip install vllm, on a machine with a GPU; "
                                 "not tested here); use --backend hf otherwise") from e
        self.vllm = vllm_module
        self.llm = llm if llm is not None else vllm_module.LLM(
            model=str(path), tokenizer=str(path), dtype="float32", tensor_parallel_size=tensor_parallel_size,
            seed=0)
        self.chunk = chunk
        # vLLM stops at the tokenizer's EOS and at every generation-config EOS (stop_token_ids): know both.
        self._tokenizer_eos = _tokenizer_eos(path)
        self._eos = _eos_from_model_dir(path) | ({self._tokenizer_eos} if self._tokenizer_eos is not None else set())

    def eos_ids(self) -> set[int]:
        return set(self._eos)

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "dtype": "float32", "chunk": self.chunk,
                "vllm_version": getattr(self.vllm, "__version__", None)}  # the module, not a backend: a fake has none

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 top_logprobs: int = 0) -> Iterator[tuple[int, Generation]]:
        if top_logprobs:
            raise ValueError("top_logprobs: the hf backend only (vLLM's per-token logprobs are not wired into the "
                             "records yet)")
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                                          stop_token_ids=sorted(self._eos))
        for start in range(0, len(prompts), self.chunk):
            idx = list(range(start, min(len(prompts), start + self.chunk)))
            requests = [{"prompt_token_ids": list(prompts[i])} for i in idx]
            outputs = self.llm.generate(prompts=requests, sampling_params=params, use_tqdm=False)
            if len(outputs) != len(requests):
                raise RuntimeError(f"vllm returned {len(outputs)} outputs for {len(requests)} requests")
            for i, out in zip(idx, outputs):
                yield i, vllm_generation(out, self._eos, self._tokenizer_eos)


def vllm_generation(request_output: Any, eos: set[int], tokenizer_eos: int | None = None) -> Generation:
    """A vLLM RequestOutput (``.outputs[0].token_ids``, ``.finish_reason`` stop|length) as a Generation whose
    tokens end with the EOS when it stopped there, like the hf backend.

    ``eos``: every id vLLM stops at (the tokenizer's EOS and the generation config's). vLLM reports a stop
    token id in ``stop_reason`` and its own EOS check (``tokenizer_eos``) as ``stop_reason=None``; an EOS is
    appended only when the output says it stopped on one and the token is not already its last."""
    completion = request_output.outputs[0]
    tokens = [int(t) for t in completion.token_ids]
    reason = completion.finish_reason
    if reason == "length":
        return Generation(tokens, "length")
    if reason != "stop":
        raise RuntimeError(f"vllm request finished with {reason!r} (expected stop or length)")
    if tokens and tokens[-1] in eos:
        return Generation(tokens, "eos")
    stop = getattr(completion, "stop_reason", None)  # vLLM's output, not ours: older releases lack the field
    if isinstance(stop, int) and stop in eos:
        return Generation(tokens + [stop], "eos")
    if stop is None and tokenizer_eos is not None:
        return Generation(tokens + [tokenizer_eos], "eos")
    raise RuntimeError(f"vllm stopped without an EOS token in its output (last token "
                       f"{tokens[-1] if tokens else None}, stop_reason={stop!r}, EOS ids {sorted(eos)})")


def _eos_from_model_dir(path: Path) -> set[int]:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = read_json(f).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {int(eos)}
    return set()


def _tokenizer_eos(path: Path) -> int | None:
    eos = load_tokenizer(path).eos_token_id
    return None if eos is None else int(eos)
