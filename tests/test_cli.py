"""The CLI surface: every stage's options come from its config, bad input is one line naming the file, exit 2."""

import json
import shutil

import pytest

from specdraft.cli import STAGES, main, stage_parser
from specdraft.core.config import config_from_args


def test_every_stage_has_help_built_from_its_config(capsys):
    for name in STAGES:
        parser, config_cls, func = stage_parser(name)
        assert callable(func)
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert f"specdraft {name}" in text
        for field, info in config_cls.model_fields.items():
            positional = isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("positional")
            assert (field if positional else "--" + field.replace("_", "-")) in text, (name, field)


def test_no_stage_prints_the_stages_and_exits_2(capsys):
    assert main([]) == 2
    text = capsys.readouterr().out
    assert all(name in text for name in STAGES) and "models" in text


def test_an_unknown_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["pack", "--no-such-option", "1"])
    assert exit_.value.code == 2 and "--no-such-option" in capsys.readouterr().err


def test_an_invalid_value_names_the_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--validation", "v.jsonl", "--lookup", "--out", "o", "--k", "0"])
    assert exit_.value.code == 2 and "k" in capsys.readouterr().err


def test_models_show_cli(tiny_qwen3_dir, capsys):
    assert main(["models", "show", str(tiny_qwen3_dir), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["layers"], shown["vocab"], shown["path"]) == (2, 320, str(tiny_qwen3_dir))
    assert main(["models", "show", str(tiny_qwen3_dir)]) == 0
    assert "layers" in capsys.readouterr().out
    assert main(["models", "show", "hub:a/b"]) == 2
    assert "not pinned" in capsys.readouterr().err


def test_cli_names_the_file_behind_bad_input(tiny_qwen3_dir, tmp_path, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, model_dir)
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text()[:-20])
    assert main(["models", "show", str(model_dir)]) == 2
    assert f"{model_dir / 'config.json'}: not a readable config.json" in capsys.readouterr().err
    bad_config = tmp_path / "pack.json"
    bad_config.write_text('{"checkpoint": ')
    with pytest.raises(SystemExit) as exit_:
        main(["pack", "--config", str(bad_config), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and f"{bad_config}: not valid JSON" in capsys.readouterr().err


def test_a_config_file_may_give_the_required_options(tmp_path, capsys):
    parser, config_cls, _ = stage_parser("speculate")
    config_file = tmp_path / "speculate.json"
    config_file.write_text(json.dumps({"draft": "lookup", "max_new_tokens": 8}))
    args = parser.parse_args(["--config", str(config_file), "--prompts", "p.jsonl", "--max-new-tokens", "4"])
    config = config_from_args(config_cls, args, args._config_file)
    assert (config.draft, str(config.prompts), config.max_new_tokens) == ("lookup", "p.jsonl", 4)  # flags win
    with pytest.raises(ValueError, match="the following arguments are required: --draft, --prompts"):
        config_from_args(config_cls, parser.parse_args([]))
    with pytest.raises(SystemExit) as exit_:
        main(["speculate", "--config", str(config_file)])
    assert exit_.value.code == 2
    assert "required: --prompts (on the command line or in the --config file)" in capsys.readouterr().err


def test_log_level_sets_the_console_and_quiets_per_request_client_lines(tmp_path, tiny_qwen3_dir, capsys):
    import logging

    assert main(["models", "show", str(tiny_qwen3_dir), "--log-level", "warning"]) == 0
    console = next(h for h in logging.getLogger().handlers if h.get_name() == "specdraft-console")
    assert console.level == logging.WARNING and logging.getLogger("httpx").level == logging.WARNING
    points = tmp_path / "v.jsonl"
    points.write_text(json.dumps({"id": "a", "context_ids": [5, 6, 5, 6, 5], "target_ids": [6] * 16}) + "\n")
    assert main(["eval", "--validation", str(points), "--lookup", "--out", str(tmp_path / "o"),
                 "--log-level", "DEBUG"]) == 0
    assert console.level == logging.DEBUG and logging.getLogger("httpx").level == logging.DEBUG
    assert "points from" in (tmp_path / "o" / "eval.log").read_text()  # the run dir's log keeps INFO
    assert main(["eval", "--validation", str(points), "--lookup", "--out", str(tmp_path / "o2"),
                 "--log-level", "ERROR"]) == 0
    assert "points from" in (tmp_path / "o2" / "eval.log").read_text()
    assert main(["models", "show", str(tiny_qwen3_dir)]) == 0  # the default again
    assert console.level == logging.INFO and logging.getLogger("httpx").level == logging.WARNING


def test_the_avx2_emulation_reaches_torch_and_the_machine_record():
    """`make test` runs the server and eval tests under these variables: they must make torch pick AVX2 kernels
    and the machine record say so, on any CPU."""
    import json
    import os
    import subprocess
    import sys

    from specdraft.core.machine import AVX2_EMULATION
    code = ("import json, torch; from specdraft.core.machine import machine; m = machine(); "
            "print(json.dumps([torch.backends.cpu.get_cpu_capability(), m['cpu_class'], m['avx2_emulation']]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **AVX2_EMULATION}, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == ["AVX2", "avx2", True]
