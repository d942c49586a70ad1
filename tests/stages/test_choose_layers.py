import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.cli import main
from specdraft.core.io import read_json
from specdraft.model.tiny import build_tiny_model
from specdraft.model.truncate import build_init


@pytest.fixture(scope="module")
def silenced_target(tmp_path_factory):
    """A 4-layer tiny target whose layer 2 adds nothing to the residual stream, and 6 of its greedy traces."""
    root = tmp_path_factory.mktemp("choose")
    path = build_tiny_model(root / "target", "llama", layers=4, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.nn.init.zeros_(model.model.layers[2].self_attn.o_proj.weight)
    torch.nn.init.zeros_(model.model.layers[2].mlp.down_proj.weight)
    model.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        ids = torch.randint(10, model.config.vocab_size, (1, 5), generator=gen)
        with torch.no_grad():
            for _ in range(12):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        rows.append({"id": f"p{i}", "prompt_ids": ids[0, :5].tolist(), "completion_ids": ids[0, 5:].tolist()})
    traces = root / "traces.jsonl"
    traces.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, traces


def _run(target, traces, out, keep, *extra):
    return main(["choose-layers", "--traces", str(traces), "--target", str(target), "--keep", str(keep),
                 "--out", str(out), "--threads", "1", *extra])


def test_the_choice_drops_the_silent_layer_and_its_init_builds(silenced_target, tmp_path):
    target, traces = silenced_target
    out = tmp_path / "layers" / "layer_choice.json"
    assert _run(target, traces, out, 3) == 0
    result = read_json(out)
    assert result["dropped"] == [2] and result["layers"] == [0, 1, 3]
    assert result["chosen"]["agreement"] == 1.0 and result["full"]["agreement"] == 1.0
    assert result["examples"] == [f"p{i}" for i in range(6)]
    assert len(result["traces"]["sha256"]) == 64 and result["target"]["weights_sha256"]
    assert out.with_suffix(".png").stat().st_size > 0 and "drop 2" in out.with_suffix(".log").read_text()
    assert not out.with_name("layer_choice.partial.json").exists()
    model, _, source = build_init(result["init"])
    assert model.config.num_hidden_layers == 3 and source["truncate_layers"] == [0, 1, 3]


def test_an_interrupted_run_continues_from_its_finished_rounds(silenced_target, tmp_path):
    target, traces = silenced_target
    first = tmp_path / "first.json"
    _run(target, traces, first, 3, "--fixed", "0")
    # a run to 2 layers that stopped after its first round: that round is taken as recorded, not recomputed
    out = tmp_path / "layer_choice.json"
    recorded = read_json(first)
    round_one = dict(recorded["rounds"][0], cross_entropy=123.0)
    partial = {"key": {"target": recorded["target"], "traces_sha256": recorded["traces"]["sha256"],
                       "examples": recorded["examples"], "fixed": [0]}, "rounds": [round_one]}
    out.with_name("layer_choice.partial.json").write_text(json.dumps(partial))
    assert _run(target, traces, out, 2, "--fixed", "0") == 0
    result = read_json(out)
    assert result["rounds"][0]["cross_entropy"] == 123.0 and len(result["rounds"]) == 2
    assert result["dropped"][0] == 2 and len(result["layers"]) == 2 and 0 in result["layers"]


def test_a_rerun_with_another_keep_starts_from_the_finished_rounds(silenced_target, tmp_path):
    """Down to fewer layers it continues after the recorded rounds; up to more it takes their first rounds; on other
    inputs it starts over. A planted score shows which rounds were taken as recorded."""
    target, traces = silenced_target
    out = tmp_path / "layer_choice.json"
    _run(target, traces, out, 3, "--fixed", "0")
    recorded = read_json(out)
    recorded["rounds"][0]["cross_entropy"] = 123.0
    out.write_text(json.dumps(recorded))
    assert _run(target, traces, out, 2, "--fixed", "0") == 0
    fewer = read_json(out)
    assert [r["cross_entropy"] for r in fewer["rounds"]][0] == 123.0 and len(fewer["rounds"]) == 2
    assert "continuing after 1 finished rounds" in out.with_suffix(".log").read_text()
    assert _run(target, traces, out, 3, "--fixed", "0") == 0
    more = read_json(out)
    assert len(more["rounds"]) == 1 and more["rounds"][0]["cross_entropy"] == 123.0 and more["layers"] == [0, 1, 3]
    assert _run(target, traces, out, 3) == 0  # other fixed layers: other inputs, scored afresh
    assert read_json(out)["rounds"][0]["cross_entropy"] != 123.0


def test_rounds_of_a_run_on_other_inputs_are_refused(silenced_target, tmp_path, capsys):
    target, traces = silenced_target
    out = tmp_path / "layer_choice.json"
    out.with_name("layer_choice.partial.json").write_text(json.dumps({"key": {"other": 1}, "rounds": []}))
    assert _run(target, traces, out, 3) != 0
    assert "rounds of a run on other inputs" in capsys.readouterr().err


def test_bad_inputs_are_refused_with_the_option(silenced_target, tmp_path, capsys):
    target, traces = silenced_target
    assert _run(target, traces, tmp_path / "a.json", 9) != 0
    assert "--keep 9" in capsys.readouterr().err
    assert _run(target, traces, tmp_path / "b.json", 3, "--max-len", "8") != 0
    assert "--max-len" in capsys.readouterr().err
