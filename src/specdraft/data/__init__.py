"""Layer 1 -- training data, no torch: the data manifest (``manifest``), record readers of every corpus format
(``readers``), the packaged prompt corpus and templates (``corpus``, ``templates``), text normalisation, the
13-gram contamination check and MinHash near-duplicates (``text``). The prompts stage
(``stages.prompts``) puts them together."""
