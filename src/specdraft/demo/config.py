"""``DemoConfig``: every setting of `specdraft demo`, defined once (the CLI is built from it).

The demo reads two kinds of data from outside the package, both declared here and both optional: ``shared_data``
(``../shared/data`` beside a checkout: more training corpora and MT-bench) and ``reference_results`` (a checkout's
``bench/results``: the measured figures the summary quotes for the larger budgets and for llama.cpp). Without them it
trains on the corpus shipped in the package and says where the reference figures live.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from specdraft.core.config import StageConfig
from specdraft.model.specs import DEFAULT_TARGET

REPO_ROOT = Path(__file__).resolve().parents[3]  # a checkout's root (nothing there when installed from a wheel)
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
REFERENCE_RESULTS = REPO_ROOT / "bench" / "results"


class DemoConfig(StageConfig):
    out: str = Field("runs/demo", description="run directory (resumable: a rerun skips finished stages)")
    budget: Literal["small", "default", "full"] = Field(
        "small", description="how much to run (small: the quick demo; the demo prints each stage's "
                             "expected time on this machine before it starts)")
    target: str = Field(DEFAULT_TARGET, description="target model: the embedded default, or a local causal-LM dir "
                                                    "with a chat template (or a pinned hub:ORG/NAME@REV)")
    draft_init: Optional[str] = Field(
        None, description="where the draft starts: a model dir or spec sharing the target's tokenizer "
                          "(from_pretrained, e.g. a smaller model of the target's family), or truncate:N / "
                          "truncate:i,j,k (the target's first N layers / those layers); default: the budget's "
                          "recipe for the embedded target, the first half of the target's layers for any other")
    freeze_layers: Optional[int] = Field(None, ge=0, description="the draft's first layers kept frozen in training "
                                                                 "(default: the budget's for the embedded "
                                                                 "target, 0 for any other)")
    device: str = Field("auto", description="the in-process stages' device: auto (cuda when available), cpu, "
                                            "cuda or cuda:N")
    manifest: Optional[str] = Field(None, description="data manifest (default: configs/manifest.shared.json "
                                                      "when the shared data is present, else the prompt corpus "
                                                      "shipped in the package)")
    eval_set: Optional[str] = Field(None, description="evaluation prompts, never trained on (default: the packaged "
                                                      "corpus's held-out set; the shared data's MT-bench, when "
                                                      "present, is evaluated beside it on both turns)")
    shared_data: Optional[str] = Field(
        str(SHARED_DATA) if SHARED_DATA.is_dir() else None,
        description="optional data folder with train/ corpora and dev/mt_bench.jsonl, evaluated on both turns "
                    "(default: ../shared/data beside this checkout when present)")
    reference_results: Optional[str] = Field(
        str(REFERENCE_RESULTS) if REFERENCE_RESULTS.is_dir() else None,
        description="optional folder of measured results (bench/results/*.json) the summary quotes for the larger "
                    "budgets and llama.cpp (default: this checkout's bench/results when present)")
    threads: Optional[int] = Field(None, description="torch CPU threads for the in-process stages")
    audit: bool = Field(True, description="end with `specdraft audit`")
