import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.core.records import Example
from specdraft.model.layer_choice import accepted_runs, choose_layers, score_layers
from specdraft.model.tiny import build_tiny_model


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny4"), "llama", layers=4, seed=3)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy_examples(model, n=6, prompt_len=5, new=12, seed=0) -> list[Example]:
    """The model's own greedy continuations: the full stack agrees with every target token."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        ids = torch.randint(10, model.config.vocab_size, (1, prompt_len), generator=gen)
        with torch.no_grad():
            for _ in range(new):
                ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        examples.append(Example(f"ex{i}", ids[0].tolist(), prompt_len))
    return examples


def _silence(model, layer: int) -> None:
    """Make a layer add nothing to the residual stream: its removal changes no output."""
    block = model.model.layers[layer]
    torch.nn.init.zeros_(block.self_attn.o_proj.weight)
    torch.nn.init.zeros_(block.mlp.down_proj.weight)


def test_accepted_runs_count_agreement_up_to_the_first_miss_capped_at_k():
    assert accepted_runs([True, True, False, True, True, True], k=16) == [2, 1, 0, 3, 2, 1]
    assert accepted_runs([True] * 5, k=3) == [3, 3, 3, 2, 1]
    assert accepted_runs([], k=4) == []


def test_the_full_stack_agrees_with_its_own_greedy_tokens(four_layer_dir):
    model = _load(four_layer_dir)
    examples = _greedy_examples(model)
    full = score_layers(model, range(4), examples, k=4)
    assert full.agreement == 1.0
    # 12 completion tokens, runs capped at 4: the last three positions run 3, 2, 1
    assert full.accepted == pytest.approx((9 * 4 + 3 + 2 + 1) / 12)
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4  # restored


def test_elimination_drops_the_layer_that_contributes_nothing(four_layer_dir):
    model = _load(four_layer_dir)
    _silence(model, 2)
    examples = _greedy_examples(model)
    rounds = choose_layers(model, examples, keep=3)
    assert [r.dropped for r in rounds] == [2]
    assert rounds[0].score.layers == [0, 1, 3]
    assert rounds[0].score.agreement == 1.0  # the silenced layer changed nothing
    assert rounds[0].runner_up == 1  # 0 and 3 are fixed by default


def test_elimination_follows_the_cross_entropy_and_keeps_fixed_layers(four_layer_dir):
    model = _load(four_layer_dir)
    examples = _greedy_examples(model)
    rounds = choose_layers(model, examples, keep=2, fixed=[0])
    assert len(rounds) == 2 and 0 in rounds[-1].score.layers and len(rounds[-1].score.layers) == 2
    # each round's choice is the best of that round's candidates
    first = rounds[0]
    for other in (1, 2, 3):
        if other != first.dropped:
            alt = score_layers(model, [i for i in range(4) if i != other], examples)
            assert first.score.cross_entropy <= alt.cross_entropy


def test_bad_keep_is_refused(four_layer_dir):
    model = _load(four_layer_dir)
    with pytest.raises(ValueError, match="keeps 1..4"):
        choose_layers(model, [], keep=5)
    with pytest.raises(ValueError, match="fewer than the 2 fixed"):
        choose_layers(model, [], keep=1)
