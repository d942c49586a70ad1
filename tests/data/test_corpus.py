"""The prompt corpus shipped in the package: big and varied enough to train on, pinned by the default manifest,
and its held-out set split off by family so that the contamination check keeps the training split whole."""

import json
from collections import Counter

import pytest

from specdraft.data.corpus import corpus_dir, heldout_path
from specdraft.data.manifest import default_manifest_dict, load_manifest
from specdraft.data.text import dedup_key, ngram_overlap
from specdraft.stages.prompts import PromptsConfig, build_prompts

KINDS = {"advice", "coding", "extraction", "factual", "math", "reasoning", "roleplay", "summarisation",
         "translation", "writing"}


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def corpus():
    train = [r for p in sorted((corpus_dir() / "train").glob("*.jsonl")) for r in _rows(p)]
    return train, _rows(heldout_path())


def test_the_corpus_is_big_varied_and_well_formed(corpus):
    train, heldout = corpus
    for row in train + heldout:
        assert set(row) == {"id", "category", "family", "prompt"} and row["prompt"].strip(), row
        assert row["family"].startswith(row["category"] + "/")
    assert len({dedup_key(r["prompt"]) for r in train}) >= 1500
    kinds = Counter(r["category"] for r in train)
    assert set(kinds) == KINDS and min(kinds.values()) >= 150, kinds
    assert len({r["id"] for r in train + heldout}) == len(train) + len(heldout)
    words = sorted(len(r["prompt"].split()) for r in train)
    assert words[len(words) // 10] <= 20 and words[-len(words) // 10] >= 100  # short and long prompts both
    assert set(Counter(r["category"] for r in heldout)) == KINDS and len(heldout) >= 100


def test_heldout_is_split_by_family_and_shares_no_13_gram_with_training(corpus):
    train, heldout = corpus
    assert not {r["family"] for r in train} & {r["family"] for r in heldout}
    assert ngram_overlap([r["prompt"] for r in train], [r["prompt"] for r in heldout], 13) == []


def test_the_default_manifest_pins_every_corpus_file():
    loaded = load_manifest(None)  # checks each file's sha256 against the manifest
    assert {c.name.removeprefix("specdraft-") for c in loaded.corpora} == KINDS
    assert all(c.kind == "packaged" and c.license == "Apache-2.0" for c in loaded.corpora)
    assert default_manifest_dict()["uses_eval_splits"] is False


def test_the_prompts_stage_keeps_the_training_split_whole(tmp_path, tiny_qwen3_dir, corpus):
    """Over the default manifest with the held-out set as the evaluation set: nothing is contaminated and
    (nearly) nothing is a near-duplicate; the corpus's long passages fit the token limit."""
    train, _ = corpus
    result = build_prompts(PromptsConfig(out=str(tmp_path / "prompts.jsonl"), tokenizer=str(tiny_qwen3_dir),
                                         max_prompt_tokens=100_000, eval_set=[str(heldout_path())]))
    stats = json.loads(result.stats_path.read_text())
    assert all(c["dropped"]["contaminated"] == 0 for c in stats["corpora"].values()), stats["corpora"]
    assert result.total >= 1500 and result.total >= 0.97 * len(train)
    assert {r["source"] for r in _rows(result.out)} == {f"specdraft-{k}" for k in KINDS}
