"""`--engine auto`: the engine a replayed speculation loop measures cheaper serves, torch on a tie; the choice and
its figures are recorded; what --engine and --gguf may be given together. (The real engines, llama.cpp's included,
are measured in test_llamacpp_engine.py.)"""

import pytest

from fakes import FakeEngine
from specdraft.server import engine_choice
from specdraft.server.config import ServeConfig
from specdraft.server.engine_choice import LoopReplay, choose_engine, load_serving_engine, replay_loop


def fake_measure(costs):
    """A replay that returns each engine's (first call, later call) seconds as given, by engine name."""
    def measure(engine, replay, num_draft):
        first, later = costs[engine.name]
        return {"first_call_s": first, "later_call_s": later, "loop_s": first + (replay.calls_per_loop - 1) * later}
    return measure


def named(name):
    engine = FakeEngine()
    engine.name = name
    return engine


@pytest.mark.parametrize("costs, chosen", [
    ({"torch": (0.5, 0.40), "llama.cpp": (1.5, 0.10)}, "llama.cpp"),  # slower first call, cheaper loop
    ({"torch": (0.5, 0.10), "llama.cpp": (0.2, 0.20)}, "torch"),
    ({"torch": (0.5, 0.104), "llama.cpp": (0.5, 0.100)}, "torch"),  # within 5%: a tie, torch serves
])
def test_the_engine_whose_loop_is_cheaper_serves_and_torch_wins_a_tie(costs, chosen):
    choice = choose_engine({"torch": named("torch"), "llama.cpp": named("llama.cpp")}, 16,
                           LoopReplay(calls_per_loop=32), measure=fake_measure(costs))
    assert choice["engine"] == chosen
    loops = {name: first + 31 * later for name, (first, later) in costs.items()}
    for name, figures in choice["candidates"].items():
        assert figures["loop_s"] == pytest.approx(loops[name])
        assert figures["ratio_to_cheapest"] == pytest.approx(loops[name] / min(loops.values()), abs=1e-3)
    assert "torch" in choice["reason"] and "llama.cpp" in choice["reason"]
    assert ("a tie" in choice["reason"]) == (chosen == "torch" and loops["torch"] > loops["llama.cpp"])


def test_a_replay_times_a_first_call_and_later_calls_that_extend_the_context():
    admitted = []
    engine = FakeEngine(hook=lambda what, contexts: admitted.extend(contexts) if what == "admit" else None)
    ticks = iter(range(1000))
    seconds = replay_loop(engine, LoopReplay(prompt_tokens=20, timed_calls=3, accepted=2, calls_per_loop=10), 8,
                          clock=lambda: next(ticks))
    assert seconds == {"first_call_s": 1, "later_call_s": 1, "loop_s": 10}  # one tick per call
    assert [len(c) for c in admitted] == [8, 20, 23, 26, 29]  # warm-up, prompt, each call 2 kept + 1 target token
    assert engine.calls[-1] == ("close", [])  # the replay's lane is freed
    for before, after in zip(admitted[1:], admitted[2:]):
        drafted = FakeEngine.expected(before, 8)
        assert after[:len(before) + 2] == before + drafted[:2] and after[-1] != drafted[2]
        assert 3 <= after[-1] < FakeEngine.vocab_size  # an ordinary token of the vocabulary
    admitted.clear()  # a server drafting 2 tokens a call keeps 1 of them
    replay_loop(engine, LoopReplay(prompt_tokens=20, timed_calls=2, accepted=2), 2, clock=lambda: next(ticks))
    assert [len(c) for c in admitted] == [8, 20, 22, 24]


def test_engine_and_gguf_are_given_together_where_they_make_sense(packed_dir):
    with pytest.raises(ValueError, match="give --gguf"):
        ServeConfig(model_dir=str(packed_dir), engine="llama.cpp")
    with pytest.raises(ValueError, match="--gguf is for"):
        ServeConfig(model_dir=str(packed_dir), engine="torch", gguf="x.gguf")
    assert ServeConfig(model_dir=str(packed_dir)).engine == "auto"


def test_auto_without_a_gguf_or_without_llamacpp_serves_torch_and_says_why(packed_dir, monkeypatch):
    engine = load_serving_engine(ServeConfig(model_dir=str(packed_dir), compute="float32", threads=1))
    assert engine.compute_choice["engine_choice"]["engine"] == "torch"
    assert "without --gguf" in engine.compute_choice["engine_choice"]["reason"]
    monkeypatch.setattr(engine_choice.importlib.util, "find_spec", lambda name: None)
    engine = load_serving_engine(ServeConfig(model_dir=str(packed_dir), compute="float32", threads=1,
                                             gguf="elsewhere.gguf"))
    assert "not installed" in engine.compute_choice["engine_choice"]["reason"]
