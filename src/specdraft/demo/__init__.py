"""`specdraft demo`: the whole pipeline on the embedded default (or a target of yours), resumable, ending with a
summary that says what its numbers mean.

manifest -> prompts -> traces -> validation -> train -> pack -> export -> serve -> eval (untrained init, trained
draft over HTTP, prompt lookup, and the self-draft: the target's own weights packed) -> speculate (specdraft's own
engine) -> speculate in llama.cpp (when llama-cpp-python is installed) -> selfcheck -> audit.

- ``demo.budgets``: how much each budget runs; ``demo.config``: ``DemoConfig``, with its optional data paths;
- ``demo.steps``: the pipeline as a declared table of steps (name, what runs, inputs, outputs, skip rule);
- ``demo.pipeline``: runs the steps (each resumed from its marker) and gathers the summary's record;
- ``demo.plan``: the machine probe before the first step, and the time each step should take here;
- ``reports.demo``: renders the summary from its record.
"""

from specdraft.demo.budgets import BUDGETS, DRAFT_INIT, FROZEN_LAYERS, SELF_DRAFT_EMBEDDING, Budget
from specdraft.demo.config import DemoConfig
from specdraft.demo.pipeline import draft_start, run_demo

__all__ = ["BUDGETS", "DRAFT_INIT", "FROZEN_LAYERS", "SELF_DRAFT_EMBEDDING", "Budget", "DemoConfig", "draft_start",
           "run_demo"]
