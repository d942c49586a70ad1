"""The run directory: where each stage of a run writes, so that whoever reads a run (the audit, the demo) finds
the same files. No torch.

    RUN_DIR/prompts/     prompts.jsonl, prompts.stats.json, data_manifest.json     (specdraft prompts)
    RUN_DIR/traces/      traces.jsonl, traces.summary.json                         (specdraft traces)
    RUN_DIR/labels/      labels.jsonl, labels.summary.json (only if trained on)    (specdraft label)
    RUN_DIR/validation/  validation.jsonl, validation.summary.json                 (specdraft validation)
    RUN_DIR/draft/       HF checkpoint + train_meta.json                           (specdraft train)
    RUN_DIR/model/       config, generation config, tokenizer, draft.qd4,
                         architecture.json, pack_recipe.json                       (specdraft pack)
    RUN_DIR/model_self/  the target itself packed as a reference draft (the demo)  (specdraft pack)
    RUN_DIR/export/      draft.gguf + draft.gguf.export.json, or an HF dir with
                         export_record.json                                        (specdraft export)
    RUN_DIR/audit/       audit.md, audit.json                                      (specdraft audit)

The main files can each be given elsewhere; the records a stage writes beside its output follow it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PathLike = str | os.PathLike


@dataclass
class RunPaths:
    run_dir: Path
    prompts: Path
    traces: Path
    validation: Path
    checkpoint: Path
    model_dir: Path
    out: Path

    @property
    def prompts_stats(self) -> Path:
        return self.prompts.with_name(self.prompts.stem + ".stats.json")

    @property
    def manifest(self) -> Path:
        return self.prompts.parent / "data_manifest.json"

    @property
    def traces_summary(self) -> Path:
        return self.traces.with_name(self.traces.stem + ".summary.json")

    @property
    def validation_summary(self) -> Path:
        return self.validation.with_name(self.validation.stem + ".summary.json")

    @property
    def train_meta(self) -> Path:
        return self.checkpoint / "train_meta.json"

    @property
    def labels(self) -> Path:
        """The run's own copy of the labels trained on (training records where it read them)."""
        return self.run_dir / "labels" / "labels.jsonl"

    @property
    def model_self(self) -> Path:
        return self.run_dir / "model_self"

    @classmethod
    def from_run_dir(cls, run_dir: PathLike, *, prompts: PathLike | None = None, traces: PathLike | None = None,
                     validation: PathLike | None = None, checkpoint: PathLike | None = None,
                     model_dir: PathLike | None = None, out: PathLike | None = None) -> "RunPaths":
        """The layout under ``run_dir``; each path given (not None, not empty) replaces its default."""
        # Absolute paths: a child process (the audit's sandboxed server) runs in another working directory.
        run = Path(run_dir).resolve()

        def given(value: PathLike | None, default: Path) -> Path:
            return Path(value).resolve() if value else default
        return cls(run_dir=run,
                   prompts=given(prompts, run / "prompts" / "prompts.jsonl"),
                   traces=given(traces, run / "traces" / "traces.jsonl"),
                   validation=given(validation, run / "validation" / "validation.jsonl"),
                   checkpoint=given(checkpoint, run / "draft"),
                   model_dir=given(model_dir, run / "model"),
                   out=given(out, run / "audit"))
