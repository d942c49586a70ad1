"""Layer 4 -- drafting: one drafter interface (``base.Drafter``) for a draft model in process (``batched``,
``cached``), the draft server (``remote``), prompt lookup (``lookup``) and lookup in front of a model
(``hybrid``); acceptance metrics (``metrics``, ``acceptance``); speculative decoding (``speculative``) and its
timing harness (``timing``)."""
