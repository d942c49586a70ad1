"""Request and response models of the HTTP API, and the one error shape every 4xx/5xx uses.

The request model is built per app (``draft_request_model``) so that the vocabulary size and the context
limit of the loaded draft are part of the schema: pydantic checks them at the edge, before anything is
queued, and they appear in ``/openapi.json``.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, create_model

MAX_ERROR_DETAILS = 20


class DraftResponse(BaseModel):
    draft_ids: list[int] = Field(description="the draft's greedy continuation, num_tokens token ids")
    model: str = Field(description="name of the draft model that produced it")


class ErrorDetail(BaseModel):
    field: str = Field(description="the request field at fault, e.g. token_ids[3], or 'body'/'headers'")
    reason: str = Field(description="what is wrong with it")


class ErrorResponse(BaseModel):
    error: str = Field(description="error class, e.g. validation_error, malformed_json, queue_full")
    message: str = Field(description="one-line summary")
    details: list[ErrorDetail] = Field(default_factory=list)


class Health(BaseModel):
    status: Literal["ok", "loading", "failed", "stopping"]
    model: str | None = None
    compute: str | None = None
    detail: str | None = None


def draft_request_model(vocab_size: int, max_context: int, num_draft: int) -> type[BaseModel]:
    """``DraftRequest`` for one loaded draft: token ids strictly ints in [0, vocab_size), at most
    ``max_context`` of them; ``num_tokens`` in [1, num_draft], default num_draft."""
    token_id = Annotated[int, Strict(), Field(ge=0, le=vocab_size - 1)]
    return create_model(
        "DraftRequest",
        __config__=ConfigDict(extra="forbid", json_schema_extra={
            "example": {"token_ids": [1, 2, 3], "num_tokens": min(num_draft, 16)}}),
        token_ids=(Annotated[list[token_id], Strict(), Field(
            min_length=1, max_length=max_context,
            description=f"context token ids, 1..{max_context} of them, each in [0, {vocab_size - 1}]; JSON "
                        "integers written as integers (1.0, true, \"1\" and null are refused)")],
            ...),
        num_tokens=(Annotated[int, Strict(), Field(
            ge=1, le=num_draft, description=f"how many draft tokens to return (1..{num_draft})")], num_draft),
    )


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
        elif err.get("type") == "extra_forbidden":
            reason = "unknown field (allowed: token_ids, num_tokens)"
        elif "input" in err and err.get("type") in ("int_type", "list_type", "model_type", "dict_type"):
            reason += f" (got {_json_type(err['input'])})"
        details.append(ErrorDetail(field=field_name(err.get("loc", ())), reason=reason))
    if len(errors) > MAX_ERROR_DETAILS:
        details.append(ErrorDetail(field="body", reason=f"... and {len(errors) - MAX_ERROR_DETAILS} more errors"))
    return details


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
