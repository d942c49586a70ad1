"""Layer 0 -- files and records, no torch: hashes, atomic writes, JSON/JSONL readers that name the file and
line (``io``), the provenance every artifact records (``provenance``), stage configs and the CLI built from them
(``config``), the readers of the files stages exchange (``records``), the resumable-stage opening (``stage``),
PNG plots (``plots``)."""
