"""The linear layers a draft computes with (quant.linear): the CPU int4 kernel on QD04 codes against the
dequantised float matmul, the float32 rescoring of the head, prefill on the dense bf16 copy, and the compute
formats of a loaded draft."""

import random

import pytest
import torch

from specdraft.model.loader import ModelLoadError
from specdraft.model.tiny import build_tiny_model
from specdraft.quant import q4g
from specdraft.quant.linear import BF16Linear, Int4Linear, apply_compute
from specdraft.server.engine import load_engine


@pytest.mark.parametrize("shape,group", [((48, 64), 32), ((320, 128), 64), ((64, 256), 128)])
def test_int4_linear_matches_dequantised_float_matmul(shape, group):
    torch.manual_seed(0)
    q = q4g.quantize(torch.randn(*shape) * 0.1, group)
    layer = Int4Linear(q)
    x = torch.randn(5, shape[1])
    ref = x.to(torch.bfloat16).float() @ q4g.dequantize(q).T  # the kernel sees bf16 activations
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (5, shape[0])
    # bf16 output rounding: relative 2^-8 of the largest output
    assert (got - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    # A wrong zero-point convention (zero = min instead of min + 8 * scale) is off by 8 steps per weight.
    wrong = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), layer.packed, group,
        torch.stack([q.scales.float(), q.mins.float()], -1).transpose(0, 1).contiguous().bfloat16()).float()
    assert (wrong - ref).abs().max() > 10 * (got - ref).abs().max()


def test_int4_head_rescoring_gives_the_float32_argmax():
    torch.manual_seed(2)
    q = q4g.quantize(torch.randn(2048, 64), 64)
    x = torch.randn(1000, 64) * 3
    ref = x @ q4g.dequantize(q).T  # float32 logits of the same 4-bit weights
    got = Int4Linear(q, rescore_top_k=8)(x)
    plain = Int4Linear(q)(x)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (plain.argmax(-1) != ref.argmax(-1)).sum() > 0  # bf16 rounding alone flips some near-ties
    win = ref.argmax(-1, keepdim=True)
    assert torch.allclose(got.gather(-1, win), ref.gather(-1, win), rtol=1e-5, atol=1e-4)


def test_int4_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    layer = Int4Linear(q4g.quantize(torch.randn(64, 128), 64))
    x = torch.randn(7, 128)
    assert torch.equal(layer(x)[2:3], layer(x[2:3]))


def test_compute_formats_on_a_packed_model(packed_dir):
    f32 = load_engine(packed_dir, None, "float32")
    int4 = load_engine(packed_dir, None, "int4")
    assert int4.load_info["from_codes"] == len([m for m in int4.model.modules() if isinstance(m, Int4Linear)]) > 0
    assert int4.bytes_per_token() < f32.bytes_per_token() / 5
    ids = torch.tensor([[5, 17, 33, 2, 99, 41]])
    with torch.inference_mode():
        a, b = f32.model(ids).logits, int4.model(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    rng = random.Random(0)
    contexts = [[rng.randrange(3, f32.vocab_size) for _ in range(n)] for n in (3, 9, 20)]
    same = sum(x == y for x, y in zip(f32.draft(contexts, 8), int4.draft(contexts, 8)))
    assert same >= 2


def test_int4_prefill_runs_dense_bf16_and_decode_runs_the_codes(packed_dir, int4_kernel_calls):
    from specdraft.model.forward import left_pad
    from specdraft.model.simple_decode import decode_step, prefill
    engine = load_engine(packed_dir, None, "int4")
    layers = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
    head = engine.model.get_output_embeddings()
    assert head.phase is None and head.rescore_top_k > 0  # one row per sequence in both passes
    body = [m for m in layers if m is not head]
    assert body and all(m.phase is body[0].phase and m.dense.dtype == torch.bfloat16 for m in body)
    ids, mask = left_pad([[5, 6, 7, 8], [9]], pad_id=0)
    with int4_kernel_calls() as calls:
        token, state = prefill(engine.model, ids, mask)
    assert body[0].phase.prefill and [a[0].shape[0] for a in calls] == [2]  # prefill: only the head (2 rows)
    with int4_kernel_calls() as calls:
        decode_step(engine.model, token, state)
    assert not body[0].phase.prefill and [a[0].shape[0] for a in calls] == [2] * len(layers)
    # The same through draft_batch (whatever engine decode.py picks), with a one-token context:
    forwards = []
    engine.model.register_forward_pre_hook(
        lambda mod, args, kw: forwards.append(body[0].phase.prefill), with_kwargs=True)  # runs after track_phase
    from specdraft.model.decode import draft_batch
    from specdraft.model.lean import lean_forward
    plan = lean_forward(engine.model)
    assert plan is not None  # built before counting (its fusion probe calls the kernel)
    # q/k/v run as one call where the kernel's row blocks let concatenated codes compute what each module does
    # (it depends on the CPU's kernel: the lean forward probes it), else one call each
    lean_calls_per_step = 1 + sum(len(layer.qkv) + 4 for layer in plan.layers)  # + o, gate, up, down; the head
    for lean in (False, True):
        forwards.clear()
        with int4_kernel_calls() as calls:
            draft_batch(engine.model, [[5, 6, 7, 8], [9]], 3, lean=lean)
        prefills, steps = forwards.count(True), forwards.count(False)
        # the 2 decode steps run every linear on its codes, through model(...) or the lean forward
        assert steps == (0 if lean else 2)
        assert prefills >= 1 and len(calls) == prefills + 2 * (lean_calls_per_step if lean else len(layers))
    off = load_engine(packed_dir, None, "int4", prefill="int4")
    assert all(m.phase is None and not hasattr(m, "dense") for m in off.model.modules() if isinstance(m, Int4Linear))


def test_int4_with_a_float32_prefill_prefills_as_float32_does_and_decodes_on_the_codes(packed_dir, int4_kernel_calls):
    """The float32 dense copy holds the codes' values: the prefill's logits are the float32 model's, bit for bit."""
    from specdraft.model.forward import left_pad
    f32 = load_engine(packed_dir, None, "float32")
    mixed = load_engine(packed_dir, None, "int4", prefill="float32")
    body = [m for m in mixed.model.modules() if isinstance(m, Int4Linear) and m.phase is not None]
    assert body and all(m.dense.dtype == torch.float32 for m in body)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10]], pad_id=0)
    with torch.inference_mode(), int4_kernel_calls() as calls:
        a = f32.model(ids, attention_mask=mask).logits
        b = mixed.model(ids, attention_mask=mask).logits
    assert len(calls) == 1  # the head alone runs on its codes (rescored); every body layer on the float32 copy
    assert torch.equal(a[..., :-1, :].argmax(-1), b[..., :-1, :].argmax(-1))
    hidden_f32 = f32.model.model(ids, attention_mask=mask).last_hidden_state
    hidden_mixed = mixed.model.model(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(hidden_f32, hidden_mixed)


def test_prefill_row_buckets_are_few_and_cap_padding_at_25_percent():
    from specdraft.quant.linear import bucket_rows
    sizes = {bucket_rows(m) for m in range(1, 8193)}
    assert len(sizes) <= 50
    assert all(m <= bucket_rows(m) <= 1.25 * m for m in range(1, 8193))


def test_prefill_is_told_from_a_decode_step_by_positions():
    from specdraft.quant.linear import INT4_EXTEND_MAX_TOKENS, is_prefill
    assert is_prefill({"position_ids": torch.tensor([[0, 1, 2], [0, 0, 1]])})
    assert is_prefill({"position_ids": torch.tensor([[0]])})  # a one-token context, alone
    assert not is_prefill({"position_ids": torch.tensor([[1], [7]])})
    assert is_prefill({"input_ids": torch.tensor([[4, 5]])}) and not is_prefill({"input_ids": torch.tensor([[4]])})
    # A short extension of a kept cache (speculative catch-up) stays on the codes; a long one is a prefill.
    assert not is_prefill({"position_ids": torch.arange(40, 43)[None]})
    assert not is_prefill({"position_ids": torch.arange(40, 40 + INT4_EXTEND_MAX_TOKENS)[None]})
    assert is_prefill({"position_ids": torch.arange(40, 41 + INT4_EXTEND_MAX_TOKENS)[None]})


def test_from_pretrained_only_without_a_weight_file(tiny_llama_dir, packed_dir, tmp_path):
    engine = load_engine(tiny_llama_dir, None, "int4")  # plain HF dir: from_pretrained, quantised at load
    assert engine.weights is None and engine.load_info["quantised_at_load"] > 0
    with pytest.raises(ModelLoadError, match="weight file not found"):
        load_engine(packed_dir, tmp_path / "nope.qd4", "int4")
    other = tmp_path / "other.qd4"
    other.write_bytes((packed_dir / "draft.qd4").read_bytes())
    with pytest.raises(ModelLoadError, match="not the weight file"):
        load_engine(packed_dir, other, "int4")


def test_apply_compute_rejects_unknown_format(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="compute"):
        apply_compute(model, "int8")


def test_int4_head_of_an_embedding_stored_raw_searches_codes_and_scores_its_rows(tiny_qwen3_dir, tmp_path):
    """An f16 embedding kept on purpose: the tied head searches on G=32 codes made at load and rescores its top
    candidates from the f16 rows, so its argmax is the float model's (here: 1,000 random hidden states)."""
    from specdraft.cli import main
    out = tmp_path / "packed-f16-embedding"
    assert main(["pack", "--checkpoint", str(tiny_qwen3_dir), "--out", str(out), "--embedding-encoding", "f16"]) == 0
    engine = load_engine(out, None, "int4")
    head = engine.model.lm_head
    assert isinstance(head, Int4Linear) and head.group_size == 32 and head.exact_rows.dtype == torch.float16
    assert engine.load_info["bf16_fallback"] == [] and engine.load_info["head_search_codes"].startswith("q4g G32")
    assert engine.load_info["from_codes"] == 14 and engine.load_info["quantised_at_load"] == 0
    emb = engine.model.get_input_embeddings().weight  # float32 values of the stored f16 rows
    torch.manual_seed(0)
    x = torch.randn(1000, emb.shape[1]) * 2
    ref = x @ emb.T
    got = head(x)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    win = ref.argmax(-1, keepdim=True)
    assert torch.allclose(got.gather(-1, win), ref.gather(-1, win), rtol=1e-5, atol=1e-4)
    searched = Int4Linear(q4g.quantize(emb, 32))(x)  # the codes alone get some argmaxes wrong
    assert (searched.argmax(-1) != ref.argmax(-1)).sum() > 0


def test_bf16_linear_takes_a_last_position_slice_as_one_matmul():
    """x[:, -1:] of a longer hidden state (a catch-up's last position) has an odd stride on its size-1 dim;
    linear on it as 3-D bf16 ran a batched matmul that copied the whole weight transposed per call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    lin = BF16Linear(torch.randn(96, 32), torch.randn(96))
    x = torch.randn(1, 3, 32)[:, -1:]
    assert x.stride() == (96, 32, 1)
    with Ops() as ops:
        y = lin(x)
    assert "aten.bmm" not in ops.seen and ("aten.mm" in ops.seen or "aten.addmm" in ops.seen), ops.seen
    expected = torch.nn.functional.linear(x.contiguous().bfloat16(), lin.weight).float() + lin.bias
    assert y.shape == (1, 1, 96) and torch.equal(y, expected)


def test_int4_runs_each_tensor_at_its_own_group_size(tmp_path):
    """A pack with layers kept on their finer G=32 grid: every linear still runs on its own codes, at its G."""
    from transformers import AutoModelForCausalLM

    from specdraft.stages.pack import PackConfig, run_pack
    src = build_tiny_model(tmp_path / "src", "qwen3")
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for m in model.model.layers[0].modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(q4g.dequantize(q4g.quantize(m.weight, 32)))
    model.save_pretrained(src)
    out = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "packed"))).out
    engine = load_engine(out, None, "int4")
    layers = {n: m for n, m in engine.model.named_modules() if isinstance(m, Int4Linear)}
    assert engine.load_info["from_codes"] == len(layers) == 15 and not engine.load_info["bf16_fallback"]
    assert {n for n, m in layers.items() if m.group_size == 32} == {
        n for n in layers if n.startswith("model.layers.0.")} and len(layers) - 7 == sum(
        m.group_size == 64 for m in layers.values())
    f32 = load_engine(out, None, "float32")
    ids = torch.tensor([[5, 17, 33, 2, 99, 41]])
    with torch.inference_mode():
        a, b = f32.model(ids).logits, engine.model(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_f32_linear_gives_a_row_the_same_bits_in_any_batch():
    """Plain float32 linear rounds a row differently by how many rows share the call (MKL's GEMV / tile paths);
    padded to the probed row block it does not: what the server's float32 needs."""
    from specdraft.quant.linear import F32Linear, f32_row_block
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64) * 0.1, torch.randn(40, 64)
    block = f32_row_block(64, torch.get_num_threads())
    assert block is not None  # some row block makes this machine's GEMM row-invariant (the probe found it)
    layer = F32Linear(weight, row_block=block)
    alone = [layer(x[i:i + 1])[0] for i in range(len(x))]
    for m in (2, 3, 5, 8, 13, 40):
        together = layer(x[:m])
        assert all(torch.equal(together[i], alone[i]) for i in range(m))
    assert torch.allclose(layer(x), x @ weight.T, atol=1e-5)


def test_a_row_invariant_float32_model_swaps_in_padded_linears_or_is_refused(packed_dir, monkeypatch):
    from specdraft.model.loader import load_draft
    from specdraft.quant import linear
    model, source = load_draft(packed_dir, "float32", row_invariant=True)
    padded = [m for m in model.modules() if isinstance(m, linear.F32Linear)]
    assert padded and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert source["compute_summary"]["f32_row_block"] == padded[0].row_block > 1
    plain, _ = load_draft(packed_dir, "float32")  # in process, a stage may take the unpadded GEMM
    assert not any(isinstance(m, linear.F32Linear) for m in plain.modules())
    monkeypatch.setattr(linear, "model_f32_row_block", lambda model: None)
    with pytest.raises(ValueError, match="float32 cannot compute each row the same"):
        load_draft(packed_dir, "float32", row_invariant=True)
