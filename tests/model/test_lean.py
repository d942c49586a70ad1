"""The written-out decode forward (specdraft.lean) against the model's own forward: bit-identical logits."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specdraft.drafting.cached import CachedDraftModel
from specdraft.model.decode import draft_batch, greedy_decode
from specdraft.model.forward import extend
from specdraft.model.lean import LeanForward, lean_forward, lean_unsupported
from specdraft.model.simple_decode import naive_greedy
from specdraft.model.slot_engine import SlotDecoder


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory):
    """A packed tiny Qwen3 whose q/k/v widths (128 / 64 / 64) end on the int4 kernel's row blocks, so that
    the lean forward fuses them (the session's default tiny model, 64 / 32 / 32, cannot be fused)."""
    from specdraft.model.tiny import build_tiny_model
    from specdraft.stages.pack import PackConfig, run_pack

    src = build_tiny_model(tmp_path_factory.mktemp("tiny-wide") / "model", "qwen3", hidden=128, heads=2, kv_heads=1)
    out = tmp_path_factory.mktemp("packed") / "model"
    run_pack(PackConfig(checkpoint=str(src), out=str(out)))
    return out


def _load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _prompts(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _causal(start, n):
    return (torch.arange(start + n) <= torch.arange(start, start + n)[:, None])[None, None]


def _lean_equals_forward_on_a_kept_cache(model):
    """Steps and short extensions on a DynamicCache: the lean logits equal the model's, bit for bit."""
    lean = LeanForward(model)
    (prompt,) = _prompts(model.config.vocab_size, [9], seed=3)
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    extend(model, prompt, ours, 0, logits_to_keep=1)
    extend(model, prompt, theirs, 0, logits_to_keep=1)
    start = len(prompt)
    for n in (1, 3, 1, 2, 5):
        ids = _prompts(model.config.vocab_size, [n], seed=start)[0]
        want = extend(model, ids, theirs, start, logits_to_keep=0)
        got = lean(torch.tensor([ids]), torch.arange(start, start + n)[None], None if n == 1 else _causal(start, n),
                   ours, logits_to_keep=0)
        assert torch.equal(got, want), n
        start += n


def test_lean_logits_equal_the_model_forward(tiny_model_dir):
    _lean_equals_forward_on_a_kept_cache(_load(tiny_model_dir))


def test_lean_logits_equal_the_model_forward_in_int4(packed_dir):
    from specdraft.server.engine import load_engine

    model = load_engine(packed_dir, None, "int4").model
    _lean_equals_forward_on_a_kept_cache(model)


def test_slot_decoder_steps_equal_with_and_without_lean(tiny_model_dir):
    model = _load(tiny_model_dir)
    prompts = _prompts(model.config.vocab_size, [3, 20, 1, 9, 14], seed=1)
    lean = greedy_decode(model, prompts, 10, stop_at_eos=False)
    plain = greedy_decode(model, prompts, 10, stop_at_eos=False, lean=False)
    assert [g.tokens for g in lean] == [g.tokens for g in plain]
    assert [g.tokens for g in lean] == [naive_greedy(model, p, 10, stop_at_eos=False).tokens for p in prompts]
    assert SlotDecoder(model, 2, 64, 4, set()).lean is not None
    assert SlotDecoder(model, 2, 64, 4, set(), lean=False).lean is None


def test_int4_draft_batch_and_cached_draft_equal_with_and_without_lean(packed_dir, int4_kernel_calls):
    from specdraft.quant.linear import Int4Linear
    from specdraft.server.engine import load_engine

    model = load_engine(packed_dir, None, "int4").model
    layers = len(model.model.layers)
    prompts = _prompts(model.config.vocab_size, [4, 30, 1, 12], seed=4)
    assert lean_forward(model) is not None  # built (and its fusion probed) before the kernel calls are counted
    with int4_kernel_calls() as calls:
        lean = draft_batch(model, prompts, 6)
    rows = [args[1].shape[0] for args in calls]  # output features of each call's codes
    assert lean == draft_batch(model, prompts, 6, lean=False)
    assert lean == [draft_batch(model, [p], 6)[0] for p in prompts]  # batched equals alone
    # Each decode step: q/k/v as one call on their concatenated codes, then o, gate, up, down, and the head.
    cfg = model.config
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert rows.count(qkv) == 5 * layers  # 5 steps after the prefill (whose linears run dense)
    assert all(isinstance(m, Int4Linear) for m in (model.model.layers[0].self_attn.q_proj, model.lm_head))
    assert len(lean_forward(model).layers[0].qkv) == 1
    # The speculative draft with its kept cache: the same proposals either way, over catch-ups and rewinds.
    rng = random.Random(7)
    with_lean, without = CachedDraftModel(model), CachedDraftModel(model, lean=False)
    assert with_lean.lean is not None and without.lean is None
    ctx = prompts[1]
    for _ in range(10):
        k = rng.choice([1, 3, 6])
        got = with_lean.draft_one(ctx, k)
        assert got == without.draft_one(ctx, k)
        ctx = ctx[: rng.randrange(1, len(ctx))] if rng.random() < 0.2 else ctx + got[: rng.randrange(0, k + 1)] + [9]


def test_lean_unsupported_models_fall_back_to_the_model_forward(tiny_qwen3_dir):
    eager = _load(tiny_qwen3_dir, attn_implementation="eager")
    assert "eager" in lean_unsupported(eager)
    assert lean_forward(eager) is None and SlotDecoder(eager, 1, 32, 4, set()).lean is None
    with pytest.raises(ValueError, match="lean forward"):
        LeanForward(eager)
    assert greedy_decode(eager, [[5, 6, 7]], 6)[0].tokens == naive_greedy(eager, [5, 6, 7], 6).tokens
    model = _load(tiny_qwen3_dir)
    model.config.model_type = "gemma"
    assert "model type" in lean_unsupported(model)


def test_lean_forward_is_rebuilt_when_a_module_is_swapped(tiny_qwen3_dir):
    from specdraft.quant.linear import apply_compute

    model = _load(tiny_qwen3_dir)
    first = lean_forward(model)
    assert first is not None and lean_forward(model) is first  # built once
    prompts = _prompts(model.config.vocab_size, [5, 11], seed=6)
    before = draft_batch(model, prompts, 5)
    apply_compute(model, "bfloat16")  # swaps every linear
    again = lean_forward(model)
    assert again is not first
    assert draft_batch(model, prompts, 5) == draft_batch(model, prompts, 5, lean=False)
    assert len(before) == 2


def test_int4_projections_are_fused_only_where_the_concatenated_codes_compute_the_same(tiny_qwen3_dir, tmp_path):
    """The default tiny model's k/v are 32 rows wide. Whether concatenated packed codes compute what the three
    modules do depends on the CPU kernel's row blocks (64 rows with AVX-512, fewer with AVX2): the probe decides,
    and where it fuses, the one call must give each module's output on any input -- and the logits stay equal."""
    from specdraft.server.engine import load_engine
    from specdraft.stages.pack import PackConfig, run_pack

    run_pack(PackConfig(checkpoint=str(tiny_qwen3_dir), out=str(tmp_path / "model")))
    model = load_engine(tmp_path / "model", None, "int4").model
    calls = lean_forward(model).layers[0].qkv
    assert len(calls) in (1, 3)
    if len(calls) == 1:
        attn = model.model.layers[0].self_attn
        x = torch.randn(3, attn.q_proj.in_features, generator=torch.Generator().manual_seed(5))
        fused = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), *calls[0][:3])
        alone = [torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), m.packed, m.group_size,
                                                             m.scales_and_zeros)
                 for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        assert torch.equal(fused, torch.cat(alone, -1))
    _lean_equals_forward_on_a_kept_cache(model)


def _step_logits(model, prompts, steps):
    """Logits of every decode step per prompt, decoding all prompts in one slot batch (``exact_rows``, as
    ``draft_batch`` does)."""
    from specdraft.model.decode import iter_greedy

    captured = []
    real_step = SlotDecoder.step

    def step(self):
        lean = self.lean
        self.lean = lambda *a, **kw: captured.append((list(self.index), lean(*a, **kw))) or captured[-1][1]
        try:
            return real_step(self)
        finally:
            self.lean = lean

    SlotDecoder.step = step
    try:
        list(iter_greedy(model, prompts, steps + 1, stop_at_eos=False, exact_rows=True))
    finally:
        SlotDecoder.step = real_step
    per_prompt = {i: [] for i in range(len(prompts))}
    for index, logits in captured:
        for row, i in enumerate(index):
            per_prompt[i].append(logits[row])
    return per_prompt


def test_a_row_in_a_batch_gets_the_logits_it_gets_alone_bit_for_bit(tmp_path):
    """The served path (int4): contexts of mixed lengths decoded side by side in one slot batch; every decode
    step's logits equal the row decoded alone, bit for bit. The CPU flash-attention kernel rounds differently
    when a row's keys are followed by other rows' columns, so attention runs row by row (without that, row 5
    here differs on the development machine), and the head's rescoring avoids einsum's batched matmul.
    The attention has the shipped draft's shape (9 query / 3 key-value heads of 64). float32 and bfloat16
    weights cannot promise this: a matmul of 1 row and of 32 rows round differently."""
    from specdraft.model.tiny import build_tiny_model
    from specdraft.server.engine import load_engine
    from specdraft.stages.pack import PackConfig, run_pack

    src = build_tiny_model(tmp_path / "float", "qwen3", hidden=576, heads=9, kv_heads=3)
    run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "packed")))
    model = load_engine(tmp_path / "packed", None, "int4").model
    prompts = _prompts(model.config.vocab_size, [198, 216, 21, 133, 262, 249], seed=0)
    batched = _step_logits(model, prompts, 6)
    for i, prompt in enumerate(prompts):
        (alone,) = _step_logits(model, [prompt], 6).values()
        assert len(alone) == len(batched[i]) == 6
        assert all(torch.equal(a, b) for a, b in zip(alone, batched[i])), i
    assert draft_batch(model, prompts, 8) == [draft_batch(model, [p], 8)[0] for p in prompts]


def test_head_rescoring_gives_a_row_the_same_logits_alone_or_batched(packed_dir):
    from specdraft.server.engine import load_engine

    head = load_engine(packed_dir, None, "int4").model.lm_head
    assert head.rescore_top_k
    x = torch.randn(6, 1, head.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head(x), torch.cat([head(x[i:i + 1]) for i in range(6)]))


def test_lean_logits_equal_the_model_forward_for_qwen2_with_qkv_bias():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert lean_unsupported(model) is None
    _lean_equals_forward_on_a_kept_cache(model)
    # int4 (quantised at load), q/k/v widths 128 / 64 / 64 so that they fuse, with their biases
    from specdraft.quant.linear import apply_compute

    wide = Qwen2ForCausalLM(Qwen2Config(**{**config.to_dict(), "hidden_size": 128, "num_attention_heads": 2,
                                           "num_key_value_heads": 1})).eval()
    apply_compute(wide, "int4")
    (fused,) = lean_forward(wide).layers[0].qkv
    packed, group_size, scales_and_zeros, sizes, bias = fused  # one _int4_matmul call: q, k, v and their biases
    assert sizes == (128, 64, 64) and bias is not None and bias.shape == (256,)
    _lean_equals_forward_on_a_kept_cache(wide)


def test_compiled_draft_steps_stay_close_to_eager_and_keep_speculation_lossless(packed_dir, caplog):
    """torch.compile'd decode steps (CompiledSteps): the compiled graph runs the one-token steps (catch-ups
    stay eager), logits within rounding of the eager forward, and speculation with it equals plain greedy."""
    from torch._dynamo.utils import counters

    from specdraft.drafting.speculative import speculative_generate
    from specdraft.model.lean import CompiledSteps
    from specdraft.model.loader import load_packed_model
    from specdraft.server.engine import load_engine

    torch._dynamo.reset()  # other tests' compiled drafts must not use up dynamo's per-function recompile limit
    graphs = counters["stats"]["unique_graphs"]
    model = load_engine(packed_dir, None, "int4").model
    compiled, eager = CachedDraftModel(model, compile=True), CachedDraftModel(model)
    assert isinstance(compiled.lean, CompiledSteps) and compiled.compiled and not eager.compiled
    assert lean_forward(model, compile=True) is compiled.lean  # built once per model, like the eager one
    (ctx,) = _prompts(model.config.vocab_size, [11], seed=5)
    rng = random.Random(3)
    caplog.set_level("INFO", logger="specdraft.model.lean")
    for _ in range(8):  # steps on a fresh cache and on one that a rewind cropped, catch-ups of several tokens
        compiled.draft_one(ctx, 4)
        eager.draft_one(ctx, 4)
        n = len(compiled.tokens)
        assert compiled.tokens == eager.tokens
        with torch.inference_mode():
            got = compiled.feed([7], n)
            want = eager.feed([7], n)
        compiled.tokens.append(7)
        eager.tokens.append(7)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        ctx = ctx[: rng.randrange(2, len(ctx))] if rng.random() < 0.3 else ctx + [rng.randrange(3, 200)] * 3
    steps = compiled.lean
    assert steps.error is None and steps.calls["compiled"] >= 8 and steps.calls["eager"] > 0
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo captured graphs: the steps did run compiled
    assert caplog.text.count("draft decode step compiled in") == 1  # the wait is announced and timed once
    # lossless: the target (here the float model the pack came from) verifies every drafted token
    target, _ = load_packed_model(packed_dir)
    prompt = _prompts(model.config.vocab_size, [6], seed=8)[0]
    want = naive_greedy(target, prompt, 24, stop_at_eos=False).tokens
    assert speculative_generate(target, compiled, prompt, 24, 3, eos_ids=set()).tokens == want


def test_a_failed_compile_falls_back_to_eager_steps_and_loses_nothing(packed_dir, monkeypatch, caplog):
    """No C++ compiler (simulated: the compiled step raises after the first layer wrote its cache): the step
    is answered eagerly with exactly the eager logits, the cache holds each position once, later steps run
    eagerly, and the error is kept."""
    import specdraft.model.lean as lean_module
    from specdraft.server.engine import load_engine

    model = load_engine(packed_dir, None, "int4").model

    def broken_compile(fn):
        def run(input_ids, position_ids, mask, cache, logits_to_keep):
            k = torch.zeros(1, model.config.num_key_value_heads, 1, model.config.head_dim)
            cache.update(k, k, 0)  # a partly run graph's write
            raise RuntimeError("InductorError: no working C++ compiler found\nmore detail")
        return run

    monkeypatch.setattr(lean_module.torch, "compile", broken_compile)
    steps = lean_module.CompiledSteps(LeanForward(model))
    (ctx,) = _prompts(model.config.vocab_size, [9], seed=2)
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    for cache in caches:
        extend(model, ctx, cache, 0, logits_to_keep=1)
    reference = LeanForward(model)
    with caplog.at_level("WARNING", logger="specdraft.model.lean"):
        for n in range(len(ctx), len(ctx) + 3):
            args = (torch.tensor([[5]]), torch.tensor([[n]]), None)
            assert torch.equal(steps(*args, caches[0]), reference(*args, caches[1]))
            assert caches[0].get_seq_length() == caches[1].get_seq_length() == n + 1
            assert all(layer.keys.shape == other.keys.shape and torch.equal(layer.keys, other.keys)
                       for layer, other in zip(caches[0].layers, caches[1].layers))
    assert steps.error == "RuntimeError: InductorError: no working C++ compiler found"
    assert steps.calls == {"compiled": 0, "eager": 3}
    assert "running it eagerly" in caplog.text


def test_the_first_compiled_step_compiles_the_cropped_cache_graph_too(packed_dir):
    """A rewind leaves the cache's tensors as views, which needs its own graph; CompiledSteps compiles it at
    the first step on a scratch copy (the caller's cache untouched), so no later step waits for a compile.
    Under inference_mode throughout, as a draft runs (tensors made outside it would be guarded apart)."""
    from torch._dynamo.utils import counters

    from specdraft.model.lean import CompiledSteps
    from specdraft.server.engine import load_engine

    torch._dynamo.reset()
    model = load_engine(packed_dir, None, "int4").model
    steps = CompiledSteps(LeanForward(model))
    (ctx,) = _prompts(model.config.vocab_size, [9], seed=4)
    cache, reference = DynamicCache(config=model.config), DynamicCache(config=model.config)
    n = len(ctx)
    with torch.inference_mode():
        for c in (cache, reference):
            extend(model, ctx, c, 0, logits_to_keep=1)
        steps(torch.tensor([[5]]), torch.tensor([[n]]), None, cache)
        extend(model, [5], reference, n, logits_to_keep=1)
    assert cache.get_seq_length() == n + 1  # the scratch copy's crop did not reach the caller's cache
    for a, b in zip(cache.layers, reference.layers):  # the new position's keys within the compiled rounding
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-3, atol=1e-3)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2
    cache.crop(-3)  # a rewind: views
    with torch.inference_mode():
        for i in range(3):
            steps(torch.tensor([[6]]), torch.tensor([[n - 2 + i]]), None, cache)
    assert counters["stats"]["unique_graphs"] == graphs and steps.calls == {"compiled": 4, "eager": 0}
