"""A drafter's spec: the report names it keeps, what it says of each drafter, and what it refuses."""

import json

import pytest

from specdraft.drafting.spec import LLAMA_CPP_RESERVED_NAMES, RESERVED_NAMES, VARIANTS, DrafterSpec


def test_names_are_the_reports_keys():
    names = {
        DrafterSpec("draft"): "draft",
        DrafterSpec("draft", variant="prob"): "draft-prob",
        DrafterSpec("draft", variant="eager"): "draft-eager",
        DrafterSpec("draft", variant="hf"): "draft-hf",
        DrafterSpec("draft", variant="reprefill"): "draft-reprefill",
        DrafterSpec("draft", behind_lookup=True): "draft+lookup",
        DrafterSpec("server", behind_lookup=True): "draft+lookup",  # the server behind lookup too, as reports had it
        DrafterSpec("server"): "server",
        DrafterSpec("lookup"): "lookup",
        DrafterSpec("self"): "self",
        DrafterSpec("self", variant="prob"): "self-prob",
        DrafterSpec("named", alias="other"): "other",
        DrafterSpec("named", alias="other", variant="prob"): "other-prob",
        DrafterSpec("init"): "init",
        DrafterSpec("draft", "llama.cpp"): "draft",
        DrafterSpec("draft", "llama.cpp", behind_lookup=True): "draft+lookup",
        DrafterSpec("self", "llama.cpp"): "self",
        DrafterSpec("ngram", "llama.cpp"): "ngram",
        DrafterSpec("self-4bit", "llama.cpp"): "self-4bit",
        DrafterSpec("named", "llama.cpp", alias="big"): "big",
    }
    for spec, name in names.items():
        assert spec.name == name, spec
        assert DrafterSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert RESERVED_NAMES == {"baseline", "draft", "draft-eager", "draft-hf", "draft-prob", "draft-reprefill",
                              "draft+lookup", "lookup", "server"}
    assert LLAMA_CPP_RESERVED_NAMES == {"ngram", "self"}
    assert len(VARIANTS) == 4


def test_labels_and_descriptions_per_engine():
    assert DrafterSpec("draft").label == DrafterSpec("server").label == "trained draft"
    assert "served over HTTP" in DrafterSpec("server").description
    assert DrafterSpec("draft", behind_lookup=True).label == "trained draft behind lookup"
    assert DrafterSpec("self").label == DrafterSpec("self", "llama.cpp").label == "self-draft"
    assert DrafterSpec("self").description != DrafterSpec("self", "llama.cpp").description
    assert DrafterSpec("ngram", "llama.cpp").label == "n-gram lookup"
    assert DrafterSpec("self-4bit", "llama.cpp").label == "4-bit self-draft"
    assert DrafterSpec("init").label == "untrained init"
    assert DrafterSpec("named", alias="other").label == "other"
    assert DrafterSpec("draft", variant="prob").label == "trained draft (probability stop rule)"
    every = [DrafterSpec(role, engine) for engine, role in
             [("torch", r) for r in ("draft", "server", "lookup", "self", "init")]
             + [("llama.cpp", r) for r in ("draft", "lookup", "self", "ngram", "self-4bit")]]
    assert all(spec.label and spec.description for spec in every)


@pytest.mark.parametrize("fields", [
    {"role": "ngram"},  # llama.cpp's own drafter, not torch's
    {"role": "server", "engine": "llama.cpp"},
    {"role": "draft", "engine": "vllm"},
    {"role": "named"},  # a NAME needed
    {"role": "draft", "alias": "x"},  # and only there
    {"role": "lookup", "behind_lookup": True},
    {"role": "lookup", "variant": "prob"},
    {"role": "self", "variant": "eager"},  # the draft's own variants
    {"role": "draft", "variant": "prob", "engine": "llama.cpp"},
    {"role": "draft", "variant": "fast"},
])
def test_a_spec_that_names_no_drafter_is_refused(fields):
    with pytest.raises(ValueError, match="drafter spec"):
        DrafterSpec(**fields)


def test_from_json_refuses_unknown_fields():
    with pytest.raises(ValueError, match="unknown fields"):
        DrafterSpec.from_json({"role": "draft", "kind": "model"})
