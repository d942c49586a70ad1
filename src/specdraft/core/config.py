"""Stage configs are pydantic models; this builds argparse options from them so defaults live once."""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict

from specdraft.core.io import read_json


class StageConfig(BaseModel):
    """Base for every stage config: strict field names, JSON round-trip, loadable from a --config file
    (``config_from_args``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    def to_json_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())


def _unwrap_optional(tp: Any) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type[BaseModel]) -> None:
    """One option per field: --field-name, with the field's description as help.

    Defaults are left to the config class (argparse default is SUPPRESS), so a value not given on the
    command line never shadows the single definition in the model. Fields marked
    ``json_schema_extra={"positional": True}`` become positional arguments.
    """
    for name, field in config_cls.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        tp = _unwrap_optional(field.annotation)
        origin = get_origin(tp)
        default = field.get_default(call_default_factory=True) if not field.is_required() else None
        kwargs: dict[str, Any] = {"help": (field.description or "") + (
            f" (default: {default!r})" if not field.is_required() else "")}
        flag = "--" + name.replace("_", "-")
        if extra.get("positional"):
            parser.add_argument(name, type=_scalar_type(tp), help=kwargs["help"])
            continue
        kwargs["default"] = argparse.SUPPRESS
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is list:
            (item,) = get_args(tp) or (str,)
            kwargs.update(action="append", type=_scalar_type(item))
        elif origin is Literal:
            kwargs.update(choices=list(get_args(tp)), type=type(get_args(tp)[0]))
        else:
            kwargs["type"] = _scalar_type(tp)
        if field.is_required():  # checked in config_from_args: a --config file may give it instead
            kwargs["help"] += " (required, here or in --config)"
        parser.add_argument(flag, *extra.get("aliases", []), dest=name, **kwargs)


def _scalar_type(tp: Any):
    if tp in (int, float, str):
        return tp
    if tp is Path:
        return Path
    return str


def config_from_args(config_cls: type[BaseModel], args: argparse.Namespace, config_file: str | None = None):

    # the file's values (a JSON object, or a ValueError naming the file), the command line's over them
    values = read_json(config_file) if config_file else {}
    values.update({k: v for k, v in vars(args).items() if k in config_cls.model_fields and v is not None})
    missing = [name for name, field in config_cls.model_fields.items() if field.is_required() and name not in values]
    if missing:
        raise ValueError("the following arguments are required: "
                         + ", ".join("--" + name.replace("_", "-") for name in missing)
                         + (" (on the command line or in the --config file)" if config_file else ""))
    return config_cls(**values)
