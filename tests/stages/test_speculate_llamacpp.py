"""`specdraft speculate --engine llama.cpp` on tiny random models exported to GGUF."""

import json

import pytest

from specdraft.cli import main
from specdraft.core.io import read_json
from specdraft.drafting.spec import DrafterSpec
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.speculate import SpeculateConfig, run_speculate

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'specdraft[llama]')")

PROMPTS = ["Write a Python function that returns the sum of a list of numbers.",
           "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Explain how speculative decoding speeds up a language model."]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_qwen3_dir):
    root = tmp_path_factory.mktemp("spec_llama")
    run_export(ExportConfig(model_dir=str(tiny_qwen3_dir), format="gguf", out=str(root / "target.gguf"), dtype="f16"))
    packed = run_pack(PackConfig(checkpoint=str(tiny_qwen3_dir), out=str(root / "model"))).out
    run_export(ExportConfig(model_dir=str(packed), format="gguf", out=str(root / "draft.gguf")))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return tiny_qwen3_dir, root / "target.gguf", root / "draft.gguf", prompts


def test_every_llama_cpp_row_from_one_command(files, tmp_path, capsys):
    src, target, draft, prompts = files
    out = tmp_path / "spec"
    args = ["speculate", "--engine", "llama.cpp", "--target", str(src), "--target-gguf", str(target),
            "--draft", str(draft), "--prompts", str(prompts), "--out", str(out), "-k", "2", "-k", "4",
            "--max-new-tokens", "12", "--num-prompts", "3", "--repeats", "2", "--threads", "1", "--no-warmup"]
    assert main(args) == 0
    report = read_json(out / "speculate.json")
    assert report["engine"] == "llama.cpp" and not report["exact_engine"] and report["llama_cpp_python"]
    assert set(report["drafters"]) == {"draft", "draft+lookup", "self", "ngram", "lookup"}
    assert report["provenance"]["target"]["gguf"] == str(target)
    assert report["provenance"]["drafters"]["draft"]["gguf"] == str(draft)
    specs = {name: DrafterSpec.from_json(spec) for name, spec in report["drafter_specs"].items()}
    assert specs["draft+lookup"] == DrafterSpec("draft", "llama.cpp", behind_lookup=True)
    assert all(spec.engine == "llama.cpp" and spec.name == name for name, spec in specs.items())
    for res in report["drafters"].values():
        for row in res["per_k"].values():
            assert row["predicted_speedup"] > 0 and 0 <= row["equal_to_plain_greedy"] <= 1
            assert len(row["speedup_repeats"]) == 2
    # the target's own file drafts what the target decodes: every drafted token accepted
    self_rows = report["prediction"]["drafters"]["self"]
    assert all(row["acceptance_per_position"][0] == 1.0 for row in self_rows.values())
    full = report["full_precision"]
    assert set(full["drafters"]) == {"self-4bit"} and full["baseline"]["tokens_per_s"] > 0
    assert full["drafter_sources"]["self-4bit"]["gguf"] == str(target)
    assert DrafterSpec.from_json(full["drafter_specs"]["self-4bit"]) == DrafterSpec("self-4bit", "llama.cpp")
    f32 = out / "target.F32.gguf"
    assert full["target"]["gguf"] == str(f32) and read_json(f32.with_name(f32.name + ".json"))["file_type"] == "F32"
    text = (out / "speculate.md").read_text()
    consistency = report["engine_consistency"]
    assert consistency["positions"] > 0 and 0 <= consistency["argmax_differs"] <= consistency["positions"]
    assert "engine_consistency" in full
    assert "llama.cpp's own plain decoding" in text and "## Full-precision target" in text
    assert consistency["pass_tokens"] == 5 and "passes of 5 tokens, as a verify pass" in text
    assert "Predicted from measured costs" in text and "Outputs equal to the engine's plain greedy" in text
    assert "self: best k=" in capsys.readouterr().out

    # a second run reuses the F32 file made for the first
    made = f32.stat().st_mtime_ns
    cfg = SpeculateConfig(engine="llama.cpp", target=str(src), target_gguf=target, draft="none", prompts=prompts,
                          out=out, k=[2], max_new_tokens=6, num_prompts=1, threads=1, warmup=False, predict=False,
                          self_draft=False, ngram_baseline=False)
    assert run_speculate(cfg) == 0 and f32.stat().st_mtime_ns == made
    assert set(read_json(out / "speculate.json")["drafters"]) == {"lookup"}


def test_llama_cpp_refusals_name_what_is_wrong(files, tmp_path):
    src, target, _, prompts = files
    common = dict(engine="llama.cpp", prompts=prompts, out=tmp_path / "o", k=[2], max_new_tokens=4, threads=1,
                  warmup=False, full_precision=False)
    with pytest.raises(ValueError, match="--target-gguf"):
        run_speculate(SpeculateConfig(target=str(src), draft="none", **common))
    with pytest.raises(ValueError, match="--draft: .*not a GGUF file"):
        run_speculate(SpeculateConfig(target=str(src), target_gguf=target, draft=str(prompts), **common))
    with pytest.raises(ValueError, match="name 'self' is taken"):
        run_speculate(SpeculateConfig(target=str(src), target_gguf=target, draft="none",
                                      also_draft=[f"self={target}"], **common))
