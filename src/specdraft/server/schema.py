"""Request and response models of the HTTP API, and the one error shape every 4xx/5xx uses.

The request model is built per app (``draft_request_model``) so that the vocabulary size and the context
limit of the loaded draft are part of the schema: pydantic checks them at the edge, before anything is
queued, and they appear in ``/openapi.json``. The sampling block (``SamplingRequest``) holds
``model.sampling.SamplingParams``' settings and a seed.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, WithJsonSchema, create_model, field_validator

from specdraft.core.wire import DRAFT_TOKENS, MAX_GUIDES, MAX_TOP_ALTERNATIVES
from specdraft.model.generation import DEFAULT_GUIDE_MIN_RATIO, DraftSampling
from specdraft.model.sampling import SamplingParams

MAX_ERROR_DETAILS = 20
# Below this a temperature divides float32 logits into infinities (NaN probabilities); 0 is greedy.
MIN_TEMPERATURE = 1e-4
MAX_SEED = 2**53 - 1  # the largest integer every JSON parser reads exactly (JavaScript's included)


class SamplingRequest(BaseModel):
    """How the draft picks its tokens: ``model.sampling.SamplingParams`` (transformers' order: temperature, then
    top-k, then top-p) and the seed of the request's own generator."""

    model_config = ConfigDict(extra="forbid")

    temperature: Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False), WithJsonSchema({
        "anyOf": [{"type": "number", "enum": [0]}, {"type": "number", "minimum": MIN_TEMPERATURE}],
        "description": f"0: greedy (the other settings are then ignored); else at least {MIN_TEMPERATURE:g}: "
                       "tokens drawn from the draft's distribution at this temperature"})] = 0.0
    top_p: Annotated[float, Strict(), Field(
        gt=0, le=1, allow_inf_nan=False,
        description="nucleus sampling: keep the most likely tokens until their mass reaches top_p (1: off)")] = 1.0
    top_k: Annotated[int, Strict(), Field(ge=0, description="keep the top_k most likely tokens (0: off)")] = 0
    seed: Annotated[int | None, Strict(), Field(
        ge=0, le=MAX_SEED, description="seeds this request's generator: the same request with the same seed gets "
                                       "the same draft, whatever it is batched with; absent: a fresh random seed")
    ] = None

    @field_validator("temperature")
    @classmethod
    def _not_vanishing(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return value

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


def draft_sampling(request: BaseModel) -> DraftSampling:
    """What a validated ``DraftRequest`` asks of the decoder's row."""
    sampling = request.sampling  # type: ignore[attr-defined]
    return DraftSampling(params=sampling.params() if sampling else SamplingParams(),
                         seed=sampling.seed if sampling else None,
                         return_probs=request.return_probs,  # type: ignore[attr-defined]
                         top_alternatives=request.top_alternatives,  # type: ignore[attr-defined]
                         stop_confidence=request.stop_confidence,  # type: ignore[attr-defined]
                         guides=guides(request),
                         guide_min_ratio=request.guide_min_ratio or DEFAULT_GUIDE_MIN_RATIO)  # type: ignore


def guides(request: BaseModel) -> tuple[tuple[int, ...], ...]:
    """A validated request's guides: its ``guide_ids`` (where given), then its ``guide_alternatives``."""
    first = [request.guide_ids] if request.guide_ids else []  # type: ignore[attr-defined]
    return tuple(tuple(g) for g in first + list(request.guide_alternatives or ()))  # type: ignore[attr-defined]


class DraftResponse(BaseModel):
    draft_ids: list[int] = Field(description="the draft's continuation, num_tokens token ids: its greedy tokens, "
                                             "or drawn as the request's sampling says")
    model: str = Field(description="name of the draft model that produced it")
    draft_probs: list[float] | None = Field(
        None, description="only with return_probs: the draft's probability of each drafted token under the "
                          "request's sampling settings; greedy drafts give 1.0 (the argmax's one-hot)")
    top_ids: list[list[int]] | None = Field(
        None, description="only with top_alternatives k: at each drafted position the k most likely tokens of the "
                          "draft's distribution under the request's settings, most likely first (equal "
                          "probabilities, e.g. the zeros of greedy or of a top-k/top-p cut, in logit order)")
    top_probs: list[list[float]] | None = Field(
        None, description="only with top_alternatives: the probabilities of top_ids, descending")
    stop_reason: Literal["length", "confidence"] | None = Field(
        None, description="only with stop_confidence: why the draft ended -- 'length': it has num_tokens tokens; "
                          "'confidence': its last token's confidence fell below stop_confidence, so it has fewer")


class ErrorDetail(BaseModel):
    field: str = Field(description="the request field at fault, e.g. token_ids[3], or 'body'/'headers'")
    reason: str = Field(description="what is wrong with it")


class ErrorResponse(BaseModel):
    error: str = Field(description="error class, e.g. validation_error, malformed_json, queue_full")
    message: str = Field(description="one-line summary")
    details: list[ErrorDetail] = Field(default_factory=list)


class PrefixCacheHealth(BaseModel):
    block_tokens: int = Field(description="contexts are prefilled, cached and reused in blocks of this many tokens")
    budget_bytes: int = Field(description="the most bytes of keys and values it keeps (--prefix-cache-mb)")
    used_bytes: int = Field(description="bytes of keys and values it holds now")
    blocks: int = Field(description="blocks it holds now")


class Health(BaseModel):
    status: Literal["ok", "loading", "failed", "stopping"]
    model: str | None = None
    compute: str | None = None
    detail: str | None = None
    compute_choice: dict[str, Any] | None = Field(
        None, description="the compute format served and why: given (--compute X), or measured at load (auto: each "
                          "candidate's estimated seconds per request for the server's work, and the CPU's features)")
    prefix_cache: PrefixCacheHealth | None = Field(
        None, description="the prefix cache's budget and use; null when it is off (--prefix-cache-mb 0) or the "
                          "draft is not loaded yet")


# A request without guides (they and their ratio absent or null), and a request a guide may go with
UNGUIDED = {name: {"type": "null"} for name in ("guide_ids", "guide_alternatives", "guide_min_ratio")}
GUIDED = {"top_alternatives": {"const": 0},
          "sampling": {"anyOf": [{"type": "null"}, {"properties": {"temperature": {"const": 0}}}]}}


def draft_request_model(vocab_size: int, max_context: int, num_draft: int) -> type[BaseModel]:
    """``DraftRequest`` for one loaded draft: token ids strictly ints in [0, vocab_size), at most
    ``max_context`` of them; ``num_tokens`` in [1, num_draft], default num_draft; the optional sampling block,
    ``return_probs``, ``top_alternatives`` (at most the vocabulary), ``stop_confidence`` (in (0, 1]) and a greedy
    draft's ``guide_ids`` (at most num_draft of them) and ``guide_alternatives`` (at most ``MAX_GUIDES`` - 1 more
    guides) with their ``guide_min_ratio`` (in (0, 1])."""
    token_id = Annotated[int, Strict(), Field(ge=0, le=vocab_size - 1)]
    top_limit = min(MAX_TOP_ALTERNATIVES, vocab_size)
    return create_model(
        "DraftRequest",
        __config__=ConfigDict(extra="forbid", json_schema_extra={
            "example": {"token_ids": [1, 2, 3], "num_tokens": min(num_draft, DRAFT_TOKENS)},
            # the fields' dependencies, in the schema too, so that clients generated from it (and schemathesis) know:
            # top_alternatives > 0 needs return_probs: true; guides need a greedy draft without top_alternatives;
            # guide_min_ratio needs a guide. One anyOf at the top level: nested under allOf, schemathesis no longer
            # generated the long contexts tests/server/test_server.py's 5xx check needs
            "anyOf": [
                {"properties": {**UNGUIDED, "top_alternatives": {"const": 0}}},
                {"properties": {**UNGUIDED, "return_probs": {"const": True}}, "required": ["return_probs"]},
                {"properties": {**GUIDED, "guide_ids": {"type": "array"}}, "required": ["guide_ids"]},
                {"properties": {**GUIDED, "guide_alternatives": {"type": "array"}},
                 "required": ["guide_alternatives"]}]}),
        token_ids=(Annotated[list[token_id], Strict(), Field(
            min_length=1, max_length=max_context,
            description=f"context token ids, 1..{max_context} of them, each in [0, {vocab_size - 1}]; JSON "
                        "integers written as integers (1.0, true, \"1\" and null are refused)")],
            ...),
        num_tokens=(Annotated[int, Strict(), Field(
            ge=1, le=num_draft, description=f"how many draft tokens to return (1..{num_draft})")], num_draft),
        sampling=(SamplingRequest | None, Field(
            None, description="how the draft picks its tokens; absent: greedy")),
        return_probs=(Annotated[bool, Strict(), Field(
            description="add draft_probs: the draft's probability of each drafted token (1.0 when greedy)")],
            False),
        top_alternatives=(Annotated[int, Strict(), Field(
            ge=0, le=top_limit, description=f"add top_ids and top_probs: the k most likely tokens at each drafted "
                                            f"position (0..{top_limit}; needs return_probs)")], 0),
        # A threshold on each token's own probability, not the in-process default (the calibrated rule): that one
        # needs acceptance rates learnt from what the target kept, which a stateless server never sees.
        stop_confidence=(Annotated[float | None, Strict(), Field(
            gt=0, le=1, allow_inf_nan=False,
            description="end the draft after the first token whose confidence is below this (that token included): "
                        "a greedy token's probability under the draft's softmax, a sampled token's under the "
                        "distribution it was drawn from. The answer then says why it ended (stop_reason) and may "
                        "hold fewer than num_tokens tokens; absent or null: always num_tokens")], None),
        guide_ids=(Annotated[list[token_id], Strict(), Field(
            min_length=1, max_length=num_draft,
            description=f"a proposed continuation (1..{num_draft} token ids; e.g. prompt lookup's copy, made by the "
                        "client) that a greedy draft follows while the draft model gives each of its tokens at least "
                        "guide_min_ratio of its most likely token's probability; from the first one it does not, "
                        "the draft is the model's own argmax. Greedy only, without top_alternatives")] | None, None),
        guide_alternatives=(Annotated[list[Annotated[list[token_id], Field(min_length=1, max_length=num_draft)]],
                                      Strict(), Field(
            min_length=1, max_length=MAX_GUIDES - 1,
            description=f"up to {MAX_GUIDES - 1} more proposed continuations, after guide_ids (each 1..{num_draft} "
                        "token ids; e.g. lookup's copies after earlier occurrences of the matched tokens), with the "
                        "same rules. At each position the draft takes, of the tokens proposed there by the guides "
                        "equal to the draft so far, the one the model finds most likely (the earlier guide on a tie), "
                        "under the same guide_min_ratio")] | None, None),
        guide_min_ratio=(Annotated[float, Strict(), Field(
            gt=0, le=1, allow_inf_nan=False,
            description=f"with a guide: the weight a guide token needs, as a fraction of the most likely token's "
                        f"probability (1: the plain greedy draft); absent: {DEFAULT_GUIDE_MIN_RATIO}")] | None, None),
        __validators__={"needs_return_probs": field_validator("top_alternatives")(_needs_return_probs),
                        "guide_greedy": field_validator("guide_ids")(_guide_needs_greedy),
                        "alternatives_greedy": field_validator("guide_alternatives")(_guide_needs_greedy),
                        "ratio_needs_guide": field_validator("guide_min_ratio")(_ratio_needs_guide)},
    )


def _needs_return_probs(cls, value: int, info: ValidationInfo) -> int:
    if value and not info.data.get("return_probs", False):
        raise ValueError("needs return_probs: true")
    return value


def _guide_needs_greedy(cls, value: list | None, info: ValidationInfo) -> list | None:
    sampling = info.data.get("sampling")
    if value is not None and sampling is not None and sampling.temperature > 0:
        raise ValueError("a guide is followed by greedy drafts only (sampling.temperature 0 or no sampling block)")
    if value is not None and info.data.get("top_alternatives"):
        raise ValueError("a guide is followed without top_alternatives only")
    return value


def _ratio_needs_guide(cls, value: float | None, info: ValidationInfo) -> float | None:
    if value is not None and not (info.data.get("guide_ids") or info.data.get("guide_alternatives")):
        raise ValueError("needs guide_ids (or guide_alternatives)")
    return value


def integral_bounds(node: Any) -> None:
    """Integer bounds written as floats in a JSON schema (FastAPI's OpenAPI model writes maximum: 319.0) made
    integers again, in place."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") and \
                    isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                integral_bounds(value)
    elif isinstance(node, list):
        for item in node:
            integral_bounds(item)


def field_name(loc: Iterable[Any]) -> str:
    """('body', 'token_ids', 3) -> 'token_ids[3]'; ('body',) -> 'body'."""
    parts = list(loc)
    if parts and parts[0] == "body" and len(parts) > 1:
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def validation_details(errors: list[dict[str, Any]]) -> list[ErrorDetail]:
    """pydantic/FastAPI errors -> [{field, reason}], capped so a 100k-element bad list stays small."""
    details = []
    for err in errors[:MAX_ERROR_DETAILS]:
        reason = str(err.get("msg", "invalid"))
        if err.get("type") == "missing":
            reason = "field required"
        elif err.get("type") == "value_error":  # our own validators' messages, without pydantic's prefix
            reason = reason.removeprefix("Value error, ")
        elif err.get("type") == "extra_forbidden":
            reason = f"unknown field (allowed: {', '.join(_allowed_fields(err.get('loc', ())))})"
        elif "input" in err and err.get("type") in ("int_type", "list_type", "model_type", "dict_type"):
            reason += f" (got {_json_type(err['input'])})"
        details.append(ErrorDetail(field=field_name(err.get("loc", ())), reason=reason))
    if len(errors) > MAX_ERROR_DETAILS:
        details.append(ErrorDetail(field="body", reason=f"... and {len(errors) - MAX_ERROR_DETAILS} more errors"))
    return details


def _allowed_fields(loc: Iterable[Any]) -> list[str]:
    """The fields of the object an unknown field was found in: the sampling block's, or the request's."""
    inside = [p for p in loc if p != "body"][:-1]
    if inside[:1] == ["sampling"]:
        return list(SamplingRequest.model_fields)
    return ["token_ids", "num_tokens", "sampling", "return_probs", "top_alternatives", "stop_confidence", "guide_ids",
            "guide_alternatives", "guide_min_ratio"]


# JSON's names for Python's types, bool before int (a bool is an int)
JSON_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "float"), (str, "string"),
              (list, "array"), (dict, "object"))


def _json_type(value: Any) -> str:
    return next((name for kind, name in JSON_TYPES if isinstance(value, kind)), type(value).__name__)
