"""The data stage: a pinned, licensed data manifest -> deduplicated, decontaminated prompts.jsonl.

`specdraft prompts --manifest M --out RUN/prompts.jsonl [--eval-set FILE ...]`; see `prompts.py` for the
filters, `manifest.py` for the schema, `readers.py` for the record readers and `text.py` for the
contamination check (`ngram_overlap`) that the audit stage reuses.
"""

from .manifest import (CorpusSpec, DataManifest, LoadedManifest, ManifestError, SourceRef, default_manifest_dict,
                       is_eval_split, load_manifest, parse_manifest_dict, templates_asset)
from .prompts import DROP_REASONS, PromptsConfig, PromptsResult, build_prompts
from .readers import (READERS, DataSourceError, MalformedRecord, get_reader, iter_file_records,
                      read_eval_prompts)
from .templates import TemplateError, expand_templates, load_templates
from .text import contamination_filter, dedup_key, near_duplicates, ngram_overlap, normalise_prompt, words

__all__ = [
    "CorpusSpec", "DataManifest", "LoadedManifest", "ManifestError", "SourceRef", "default_manifest_dict",
    "is_eval_split", "load_manifest", "parse_manifest_dict", "templates_asset",
    "DROP_REASONS", "PromptsConfig", "PromptsResult", "build_prompts",
    "READERS", "DataSourceError", "MalformedRecord", "get_reader", "iter_file_records", "read_eval_prompts",
    "TemplateError", "expand_templates", "load_templates",
    "contamination_filter", "dedup_key", "near_duplicates", "ngram_overlap", "normalise_prompt", "words",
]
