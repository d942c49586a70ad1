"""specdraft.core.config: the stage config base and the argparse options built from a config class."""

import argparse
import json
from pathlib import Path
from typing import Literal, Optional

import pytest
from pydantic import Field, ValidationError

from specdraft.core.config import StageConfig, add_config_arguments, config_from_args


class DemoConfig(StageConfig):
    source: Path = Field(description="input file", json_schema_extra={"positional": True})
    out: Path = Field(description="output folder")
    steps: int = Field(10, gt=0, description="how many")
    rate: float = 0.5
    name: Optional[str] = Field(None, description="a label")
    mode: Literal["fast", "slow"] = "fast"
    verbose: bool = Field(False, description="say more")
    tags: list[str] = Field(default_factory=list, description="repeatable")
    sizes: list[int] | None = None
    num_draft: int = Field(4, description="draft tokens", json_schema_extra={"aliases": ["--k"]})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    add_config_arguments(parser, DemoConfig)
    return parser


# --------------------------------------------------------------------------------------------- StageConfig

def test_unknown_fields_are_refused_by_name():
    with pytest.raises(ValidationError) as e:
        DemoConfig(source="s", out="o", stpes=3)
    assert e.value.errors()[0]["loc"] == ("stpes",) and e.value.errors()[0]["type"] == "extra_forbidden"


def test_invalid_values_name_the_field():
    with pytest.raises(ValidationError) as e:
        DemoConfig(source="s", out="o", steps=0)
    assert [err["loc"] for err in e.value.errors()] == [("steps",)]
    assert "steps" in str(e.value) and "greater than 0" in str(e.value)
    with pytest.raises(ValidationError) as e:
        DemoConfig(source="s", out="o", mode="medium")
    assert [err["loc"] for err in e.value.errors()] == [("mode",)]
    with pytest.raises(ValidationError) as e:
        DemoConfig(source="s")
    assert [(err["loc"], err["type"]) for err in e.value.errors()] == [(("out",), "missing")]


def test_defaults_and_the_json_dict_round_trip():
    cfg = DemoConfig(source="in.jsonl", out=Path("o"))
    d = cfg.to_json_dict()
    assert d == {"source": "in.jsonl", "out": "o", "steps": 10, "rate": 0.5, "name": None, "mode": "fast",
                 "verbose": False, "tags": [], "sizes": None, "num_draft": 4}
    assert json.loads(json.dumps(d)) == d  # plain JSON: paths are strings
    assert DemoConfig(**d) == cfg


# ------------------------------------------------------------------------------------ add_config_arguments

def test_options_left_out_are_not_in_the_namespace():
    args = _parser().parse_args(["in.jsonl"])
    assert vars(args) == {"source": Path("in.jsonl")}  # argparse defaults never shadow the model's


def test_each_field_kind_becomes_its_option():
    args = _parser().parse_args(["in.jsonl", "--out", "o", "--steps", "3", "--rate", "0.25", "--name", "n",
                                 "--mode", "slow", "--verbose", "--tags", "a", "--tags", "b", "--sizes", "1",
                                 "--sizes", "2", "--k", "8"])
    assert vars(args) == {"source": Path("in.jsonl"), "out": Path("o"), "steps": 3, "rate": 0.25, "name": "n",
                          "mode": "slow", "verbose": True, "tags": ["a", "b"], "sizes": [1, 2], "num_draft": 8}
    assert _parser().parse_args(["x", "--no-verbose"]).verbose is False
    assert _parser().parse_args(["x", "--num-draft", "2"]).num_draft == 2


@pytest.mark.parametrize("argv, says", [
    (["x", "--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
    (["x", "--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["x", "--sizes", "1.5"], "argument --sizes: invalid int value: '1.5'"),
    ([], "the following arguments are required: source"),
])
def test_bad_command_lines_are_usage_errors_naming_the_option(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_help_carries_descriptions_defaults_and_required(capsys):
    help_text = " ".join(_parser().format_help().split())
    expected = ["--steps STEPS how many (default: 10)", "--verbose, --no-verbose say more (default: False)",
                "--mode {fast,slow}", "(default: 'fast')", "--tags TAGS repeatable (default: [])",
                "--num-draft NUM_DRAFT, --k NUM_DRAFT draft tokens (default: 4)",
                "--out OUT output folder (required, here or in --config)", "source input file"]
    assert [fragment for fragment in expected if fragment not in help_text] == []
    assert "source input file (default" not in help_text


# --------------------------------------------------------------------------------------- config_from_args

def test_the_command_line_wins_over_the_config_file(tmp_path):
    config_file = tmp_path / "demo.json"
    config_file.write_text(json.dumps({"out": "from_file", "steps": 5, "rate": 0.1, "tags": ["f"]}))
    args = _parser().parse_args(["in.jsonl", "--steps", "7", "--tags", "cli"])
    cfg = config_from_args(DemoConfig, args, str(config_file))
    assert (str(cfg.out), cfg.steps, cfg.rate, cfg.tags, str(cfg.source)) == ("from_file", 7, 0.1, ["cli"],
                                                                              "in.jsonl")
    assert cfg.num_draft == 4  # neither gave it: the model's default


def test_none_and_foreign_namespace_entries_are_ignored():
    args = argparse.Namespace(source="s", out="o", name=None, log_level="INFO", _config_file=None)
    cfg = config_from_args(DemoConfig, args)
    assert (cfg.name, str(cfg.out)) == (None, "o")


def test_missing_required_fields_are_listed_as_options():
    with pytest.raises(ValueError) as e:
        config_from_args(DemoConfig, argparse.Namespace(steps=3))
    assert str(e.value) == "the following arguments are required: --source, --out"


def test_the_config_file_is_read_and_named_on_errors(tmp_path):
    config_file = tmp_path / "demo.json"
    config_file.write_text(json.dumps({"source": "s"}))
    with pytest.raises(ValueError) as e:
        config_from_args(DemoConfig, argparse.Namespace(), str(config_file))
    assert str(e.value) == "the following arguments are required: --out (on the command line or in the --config file)"
    config_file.write_text("[1]")
    with pytest.raises(ValueError, match=f"^{config_file}: expected a JSON object, found list$"):
        config_from_args(DemoConfig, argparse.Namespace(), str(config_file))
    config_file.write_text(json.dumps({"source": "s", "out": "o", "stpes": 1}))
    with pytest.raises(ValidationError, match="stpes"):
        config_from_args(DemoConfig, argparse.Namespace(), str(config_file))
