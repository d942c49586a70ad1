"""`specdraft audit`'s one config: where the run is, and how far each check goes."""

from __future__ import annotations

from pydantic import Field

from specdraft.core.config import StageConfig
from specdraft.core.layout import RunPaths


class AuditConfig(StageConfig):
    """Check every link of a run: data -> traces -> training -> pack -> serve."""

    run_dir: str = Field(..., description="run directory (prompts/, traces/, validation/, draft/, model/)",
                         json_schema_extra={"positional": True})
    prompts: str | None = Field(None, description="prompts.jsonl (unset: RUN_DIR/prompts/prompts.jsonl); "
                                                  "prompts.stats.json and data_manifest.json are read beside it")
    traces: str | None = Field(None, description="traces.jsonl (unset: RUN_DIR/traces/traces.jsonl); "
                                                 "traces.summary.json is read beside it")
    validation: str | None = Field(None, description="validation.jsonl (unset: RUN_DIR/validation/"
                                                     "validation.jsonl); validation.summary.json beside it")
    checkpoint: str | None = Field(None, description="training output dir with train_meta.json "
                                                     "(unset: RUN_DIR/draft)")
    model_dir: str | None = Field(None, description="packed model dir (unset: RUN_DIR/model)")
    eval_set: list[str] = Field(default=[], description="evaluation prompt file (repeatable) for the contamination "
                                                        "check (none given: the eval sets recorded in "
                                                        "prompts.stats.json and validation.summary.json)")
    out: str | None = Field(None, description="where audit.md / audit.json go (unset: RUN_DIR/audit)")
    ngram: int | None = Field(None, ge=1, description="n of the word n-gram contamination check (unset: the "
                                                      "prompts stage's, else 13)")
    greedy_check: int = Field(4, ge=0, description="traces re-scored with the target (hf and vllm traces: its "
                                                   "teacher-forced argmax must equal every completion token; "
                                                   "llama.cpp traces: decoded again from the same GGUF file, token "
                                                   "for token); 0 turns it off")
    greedy_check_max_gb: float = Field(4.0, gt=0, description="skip the greedy re-score on CPU when the target's "
                                                              "weight files (llama.cpp traces: its GGUF file) exceed "
                                                              "this many GB (on a GPU the torch re-score runs)")
    serve_check: bool = Field(True, description="start the server in a sandbox (no outgoing sockets, every file "
                                                "open recorded), send one /draft, stop it")
    serve_timeout_s: float = Field(120.0, gt=0, description="bound on the whole sandboxed server check")
    max_listed: int = Field(20, ge=1, description="offenders listed per finding")

    def run_paths(self) -> RunPaths:
        """The run's layout with the paths this config overrides."""
        return RunPaths.from_run_dir(self.run_dir, prompts=self.prompts, traces=self.traces,
                                     validation=self.validation, checkpoint=self.checkpoint,
                                     model_dir=self.model_dir, out=self.out)
