"""Which of the target's layers a draft cut from it keeps: ``specdraft choose-layers``.

A ``truncate:`` draft (the target's own layers, trained) accepts far more when the layers it drops are the ones the
rest depend on least, and which those are is the target's property, not their position. This stage runs the greedy
elimination of ``model.layer_choice`` on a few of the target's greedy traces and writes the ``truncate:`` spec to
train from, with every round's scores:

    specdraft choose-layers --traces RUN/traces/traces.jsonl --keep 24 --out RUN/layers/layer_choice.json
    specdraft train --init "$(jq -r .init RUN/layers/layer_choice.json)" ...

Output: the JSON (``init``, ``layers``, ``rounds``, the target and traces it was scored on with their hashes, the
config), ``layer_choice.log`` and ``layer_choice.png`` (the scores per layers kept) beside it. Each round is
recorded as it ends, so an interrupted run continues from its last finished round (the rounds of a run on other
inputs are refused), and a rerun on the same inputs with another ``--keep`` starts from the rounds the JSON holds.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import Field

from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_json, read_json, sha256_file
from specdraft.core.plots import plot_lines
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.core.records import Example, read_traces
from specdraft.core.stage import recorded_target
from specdraft.model.device import DEVICE_HELP, resolve_device
from specdraft.model.layer_choice import LayerDrop, choose_layers, score_layers
from specdraft.model.specs import DEFAULT_TARGET, describe_source, load_model

log = logging.getLogger(__name__)


class ChooseLayersConfig(StageConfig):
    traces: str = Field(description="greedy traces of the target (`specdraft traces`): the tokens scored")
    keep: int = Field(ge=1, description="decoder layers the draft keeps")
    out: str = Field(description="output JSON (layer_choice.json); its .log and .png go beside it")
    target: Optional[str] = Field(None, description="target model spec (default: the one recorded beside the "
                                                    "traces, else the embedded default)")
    examples: int = Field(16, ge=1, description="traces scored (each candidate costs one forward over them)")
    first_row: int = Field(0, ge=0, description="the first row of the traces file to score (leave out rows a "
                                                "run trains on)")
    max_len: int = Field(300, ge=8, description="skip traces longer than this many tokens")
    fixed: Optional[list[int]] = Field(None, description="layers never removed (default: the first and the last)")
    device: str = Field("auto", description=DEVICE_HELP)
    threads: Optional[int] = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")


def select_examples(cfg: ChooseLayersConfig) -> list[Example]:
    """The first ``examples`` traces of at most ``max_len`` tokens from row ``first_row`` on."""
    rows = [e for e in read_traces(cfg.traces, max_seq_len=10 ** 9)[cfg.first_row:]
            if len(e.input_ids) <= cfg.max_len]
    if not rows:
        raise ValueError(f"{cfg.traces}: no trace of at most {cfg.max_len} tokens from row {cfg.first_row} on "
                         "(--max-len, --first-row)")
    return rows[:cfg.examples]


def run_choose_layers(cfg: ChooseLayersConfig) -> dict[str, Any]:
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with stage_log(out.with_suffix(".log")):
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        target_spec = cfg.target or recorded_target(cfg.traces) or DEFAULT_TARGET
        device = resolve_device(cfg.device)
        model = load_model(target_spec, device=device)
        n_layers = model.config.num_hidden_layers
        if cfg.keep > n_layers:
            raise ValueError(f"--keep {cfg.keep}: the target {target_spec} has {n_layers} layers")
        examples = select_examples(cfg)
        key = _inputs_key(describe_source(target_spec), sha256_file(cfg.traces), [e.id for e in examples], cfg.fixed)
        partial = out.with_name(out.stem + ".partial.json")
        done = _resumable_rounds(partial, key) or _finished_rounds(out, key, cfg.keep)
        log.info("choose-layers: %s, %d -> %d layers, %d traces (%d completion tokens)%s", target_spec, n_layers,
                 cfg.keep, len(examples), sum(len(e.completion) for e in examples),
                 f", continuing after {len(done)} finished rounds" if done else "")

        started = time.perf_counter()
        full = score_layers(model, range(n_layers), examples)
        rounds: list[LayerDrop] = list(done)

        def record(drop: LayerDrop) -> None:
            rounds.append(drop)
            atomic_write_json(partial, {"key": key, "rounds": [r.to_json() for r in rounds]})
            log.info("%d layers: drop %d (runner-up %s): cross-entropy %.3f, agreement %.3f, accepted %.2f of 16",
                     len(drop.score.layers), drop.dropped, drop.runner_up, drop.score.cross_entropy,
                     drop.score.agreement, drop.score.accepted)

        choose_layers(model, examples, cfg.keep, fixed=cfg.fixed, done=done, progress=record)
        chosen = rounds[-1].score if rounds else full
        result = {
            "stage": "choose-layers", "config": cfg.to_json_dict(), "target": key["target"],
            "traces": {"path": str(cfg.traces), "sha256": key["traces_sha256"]}, "examples": key["examples"],
            "init": f"truncate:{target_spec}:" + ",".join(map(str, chosen.layers)),
            "layers": chosen.layers, "dropped": [r.dropped for r in rounds],
            "full": full.to_json(), "chosen": chosen.to_json(), "rounds": [r.to_json() for r in rounds],
            "seconds_this_run": round(time.perf_counter() - started, 1), **run_metadata(),
        }
        atomic_write_json(out, result)
        partial.unlink(missing_ok=True)
        scores = [full, *(r.score for r in rounds)]
        plot_lines({"accepted of 16 (teacher-forced)": {len(s.layers): s.accepted for s in scores}},
                   out.with_suffix(".png"), xlabel="layers kept", ylabel="mean accepted of 16",
                   title=f"greedy layer elimination, {target_spec}")
        log.info("choose-layers: keep %s (accepted %.2f of 16 teacher-forced, the full stack %.2f): %s",
                 chosen.layers, chosen.accepted, full.accepted, result["init"])
        return result


def _inputs_key(target: dict[str, Any], traces_sha256: str, examples: list[str], fixed: list[int] | None) -> dict:
    """What a search's rounds depend on: another run continues from them only where this is the same."""
    return {"target": target, "traces_sha256": traces_sha256, "examples": examples, "fixed": fixed}


def _finished_rounds(out: Path, key: dict[str, Any], keep: int) -> list[LayerDrop]:
    """The rounds of a finished run on the same inputs (``out`` itself) down to ``keep`` layers: the elimination is
    deterministic, so a run to fewer layers continues from them and a run to more takes their first rounds."""
    if not out.is_file():
        return []
    recorded = read_json(out)
    same = _inputs_key(recorded.get("target"), recorded.get("traces", {}).get("sha256"), recorded.get("examples"),
                       recorded.get("config", {}).get("fixed")) == key
    return [LayerDrop.from_json(r) for r in recorded.get("rounds", []) if len(r["layers"]) >= keep] if same else []


def _resumable_rounds(partial: Path, key: dict[str, Any]) -> list[LayerDrop]:
    """The finished rounds of an interrupted run on the same inputs; a run on other inputs is refused."""
    if not partial.is_file():
        return []
    recorded = read_json(partial)
    if recorded.get("key") != key:
        raise ValueError(f"{partial}: rounds of a run on other inputs (target, traces, examples or fixed layers "
                         "differ); remove it to start over")
    return [LayerDrop.from_json(r) for r in recorded["rounds"]]
