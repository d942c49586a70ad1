"""``--device``: the same code on another device with one flag. The plumbing is tested on the CPU; the runs on
CUDA are marked ``gpu`` (skipped without it)."""

import json

import pytest
import torch

from specdraft.cli import main
from specdraft.model.decode import draft_batch
from specdraft.model.device import resolve_device
from specdraft.model.loader import load_draft
from specdraft.quant.linear import BF16Linear, Int4Linear, apply_compute
from specdraft.stages.pack import PackConfig, run_pack

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def packed(tiny_qwen3_dir, tmp_path_factory):
    return run_pack(PackConfig(checkpoint=str(tiny_qwen3_dir), out=str(tmp_path_factory.mktemp("p") / "m"))).out


def test_auto_is_cuda_when_there_is_one_and_a_missing_cuda_is_named():
    assert resolve_device("auto") == ("cpu" if NO_CUDA else "cuda")
    assert resolve_device("cpu") == "cpu"
    if NO_CUDA:
        with pytest.raises(ValueError, match="device 'cuda:1': CUDA is not available"):
            resolve_device("cuda:1")


def test_int4_off_the_cpu_runs_in_bfloat16_and_says_so(packed, caplog):
    model, _ = load_draft(packed, "float32")
    with caplog.at_level("WARNING"):
        summary = apply_compute(model, "int4", device="cuda")  # the choice only; nothing moves here
    linears = [m for m in model.modules() if isinstance(m, (BF16Linear, Int4Linear))]
    assert linears and all(isinstance(m, BF16Linear) for m in linears)
    assert summary["compute"] == "bfloat16" and "CPU int4 kernel" in summary["int4_fallback"]
    assert "runs in bfloat16" in caplog.text or "run in bfloat16" in caplog.text


def test_the_loader_records_its_device_and_refuses_a_missing_one(packed):
    model, source = load_draft(packed, "int4", device="cpu")
    assert source["device"] == "cpu" and next(model.parameters()).device.type == "cpu"
    assert "int4_fallback" not in source["compute_summary"]
    if NO_CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_draft(packed, "int4", device="cuda")


def test_stages_take_device_and_refuse_a_missing_one_as_bad_input(packed, tmp_path, capsys):
    points = tmp_path / "v.jsonl"
    points.write_text(json.dumps({"id": "a", "context_ids": [5, 6, 7], "target_ids": [6] * 16}) + "\n")
    assert main(["eval", "--validation", str(points), "--model-dir", str(packed), "--out", str(tmp_path / "e"),
                 "--device", "cpu", "--compute", "int4"]) == 0
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert report["drafter_source"]["device"] == "cpu"
    if NO_CUDA:
        assert main(["eval", "--validation", str(points), "--model-dir", str(packed), "--out", str(tmp_path / "f"),
                     "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_packed_draft_on_cuda_drafts_what_bfloat16_drafts_on_the_cpu(packed):
    cuda, source = load_draft(packed, "int4", device="cuda")
    assert source["compute_summary"]["compute"] == "bfloat16" and next(cuda.parameters()).is_cuda
    cpu, _ = load_draft(packed, "bfloat16", device="cpu")
    contexts = [[5, 9, 33, 70], [12, 8, 40, 41, 42, 43]]
    got, want = draft_batch(cuda, contexts, 8), draft_batch(cpu, contexts, 8)
    assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 12  # bf16 kernels round differently


@pytest.mark.gpu
def test_speculate_runs_the_target_and_draft_on_cuda(packed, tiny_qwen3_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_ids": [5, 6, 7, 8]}) + "\n")
    assert main(["speculate", "--target", str(tiny_qwen3_dir), "--draft", str(packed), "--prompts", str(prompts),
                 "--out", str(tmp_path / "s"), "--max-new-tokens", "8", "-k", "4", "--device", "cuda"]) == 0
    assert json.loads((tmp_path / "s" / "speculate.json").read_text())["lossless"]
