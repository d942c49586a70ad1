"""Layer 3 -- models: specs and their resolution to local dirs (``specs``), the one draft loader (``loader``),
the batched greedy decode loop (``decode``) and its written-out forward (``lean``), chat templating (``chat``),
layer truncation (``truncate``), tiny random models for tests (``tiny``)."""
