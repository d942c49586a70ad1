"""`specdraft <stage>`: parse arguments into the stage's config and call one stage function.

Each stage module (``specdraft.stages.*``, the demo, the audit) defines a pydantic config (the single place its
defaults live) and a function that takes it. A stage's module is imported when that stage runs, from the
``STAGES`` table, so that one stage does not pay for the others' imports (the server's, say).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from specdraft.core.config import add_config_arguments, config_from_args
from specdraft.model.specs import model_summary

# stage -> (module, config class, function, one-line help)
STAGES: dict[str, tuple[str, str, str, str]] = {
    "prompts": ("specdraft.stages.prompts", "PromptsConfig", "build_prompts",
                "build prompts.jsonl from a data manifest (dedup, quotas, contamination check)"),
    "traces": ("specdraft.stages.traces", "TracesConfig", "run_traces",
               "the target's greedy continuations of the prompts (resumable)"),
    "conversations": ("specdraft.stages.conversations", "ConversationsConfig", "run_conversations",
                      "training rows holding the target's own first answer: a follow-up turn after it, or it as a "
                      "passage to summarise, translate or answer from"),
    "merge-traces": ("specdraft.stages.traces", "MergeTracesConfig", "run_merge_traces",
                     "merge the shards of one traces run (--shard i/n) into one traces file"),
    "validation": ("specdraft.stages.traces", "ValidationConfig", "run_validation",
                   "held-out evaluation points: context_ids and the target's next 16 greedy tokens"),
    "label": ("specdraft.stages.label", "LabelConfig", "run_label",
              "teacher-forced labels: the target's argmax at every position of reference answers"),
    "choose-layers": ("specdraft.stages.choose_layers", "ChooseLayersConfig", "run_choose_layers",
                      "which of the target's layers a truncate: draft keeps (greedy elimination on traces)"),
    "train": ("specdraft.stages.train", "TrainConfig", "run_train", "distil the draft from the target's traces"),
    "pack": ("specdraft.stages.pack", "PackConfig", "run_pack", "pack a checkpoint into the QD04 4-bit model dir"),
    "export": ("specdraft.stages.export", "ExportConfig", "run_export", "export the draft as GGUF or HF safetensors"),
    "serve": ("specdraft.stages.serve", "ServeConfig", "run_serve", "serve POST /draft over HTTP"),
    "eval": ("specdraft.stages.evaluate", "EvalConfig", "run_eval", "acceptance of a drafter on validation points"),
    "speculate": ("specdraft.stages.speculate", "SpeculateConfig", "run_speculate",
                  "lossless greedy speculative decoding, timed against plain greedy"),
    "selfcheck": ("specdraft.stages.selfcheck", "SelfcheckConfig", "run_selfcheck",
                  "start the server on a packed model dir and check it end to end"),
    "demo": ("specdraft.demo", "DemoConfig", "run_demo", "the whole pipeline on the embedded default or a "
                                                          "target of your own (--target DIR)"),
    "rehearse": ("specdraft.rehearsal", "RehearseConfig", "run_rehearsal",
                 "the reference path (Qwen3) through every stage on the real Qwen3 tokenizer, with Qwen3-shaped "
                 "stand-in models"),
    "audit": ("specdraft.audit", "AuditConfig", "run_audit", "prove where every artifact of a run came from"),
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# One INFO line per request: an eval against the server or a speculation through it would print thousands
CHATTY_LOGGERS = ("httpx", "httpcore")


def configure_logging(level: str = "INFO") -> None:
    """The console shows ``level`` and above; a stage's own log file keeps INFO (``core.provenance.stage_log``).
    Per-request client lines only at DEBUG."""
    root = logging.getLogger()
    console = next((h for h in root.handlers if h.get_name() == "specdraft-console"), None)
    if console is None:
        console = logging.StreamHandler()
        console.set_name("specdraft-console")
        console.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(console)
    console.setLevel(level)
    root.setLevel(min(logging.getLevelName(level), logging.INFO))
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="INFO", type=str.upper,
                        help="console log level (default: INFO; the run dir's log file keeps INFO)")


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft", description="Draft models for speculative decoding.")
    _add_log_level(parser)
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    models = sub.add_parser("models", help="model specs: show what a spec resolves to")
    models_sub = models.add_subparsers(dest="models_cmd", required=True)
    show = models_sub.add_parser("show", help="architecture and local path of a model spec")
    show.add_argument("spec", help="local dir | hub:ORG/NAME@REVISION | embedded:NAME")
    show.add_argument("--json", action="store_true", help="print JSON")
    _add_log_level(show)
    for name, (_, _, _, help_text) in STAGES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def stage_parser(name: str):
    module_name, config_name, func_name, help_text = STAGES[name]
    module = importlib.import_module(module_name)
    config_cls = getattr(module, config_name)
    parser = argparse.ArgumentParser(prog=f"specdraft {name}", description=help_text)
    parser.add_argument("--config", dest="_config_file", default=None,
                        help="JSON file with config values (command-line options override it)")
    _add_log_level(parser)
    add_config_arguments(parser, config_cls)
    return parser, config_cls, getattr(module, func_name)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in STAGES:
        parser, config_cls, func = stage_parser(argv[0])
        args = parser.parse_args(argv[1:])
        configure_logging(args.log_level)
        try:
            config = config_from_args(config_cls, args, args._config_file)
        except Exception as e:  # pydantic ValidationError: show it as a usage error, not a traceback
            parser.error(str(e))
        try:
            result = func(config)
        except (ValueError, OSError) as e:  # bad input or files (the stages name the path and the reason)
            if os.environ.get("SPECDRAFT_TRACEBACK"):
                raise
            logging.getLogger("specdraft").debug("specdraft %s failed", argv[0], exc_info=True)
            print(f"specdraft {argv[0]}: error: {e}\n(set SPECDRAFT_TRACEBACK=1 for the traceback)", file=sys.stderr)
            return 2  # as `specdraft serve` and `models show` do for bad input
        return int(result) if isinstance(result, int) else 0
    args = _top_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.stage == "models":
        return _models_show(args.spec, args.json)
    _top_parser().print_help()
    return 2


def _models_show(spec: str, as_json: bool) -> int:
    try:
        summary = model_summary(spec)
    except (ValueError, OSError) as e:  # a bad spec (ModelSpecError), an unreadable config.json or weights
        print(f"error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(map(len, summary))
        for key, value in summary.items():
            if key == "parameters" and value:
                value = f"{value:,} ({value / 1e6:.1f}M)"
            print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
