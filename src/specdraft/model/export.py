"""The draft in the formats other engines load: a GGUF file (llama.cpp: ``write_gguf``) and a plain Hugging Face
safetensors dir (transformers, vLLM, SGLang: ``write_hf``), from a packed dir (QD04) or a float HF dir alike
(``read_source``).

Each writer returns, tensor by tensor, what it wrote and whether that holds exactly the float32 values
specdraft's own loader computes with (``load_draft(dir, "float32")``). Exactness is measured, not assumed: the
written bytes are decoded again (Q4_1 by gguf-py, llama.cpp's reference reader) and compared bit for bit. The
GGUF metadata follows llama.cpp's ``convert_hf_to_gguf.py`` for a GPT-2-style byte-level BPE tokenizer, so that
llama.cpp's draft/target vocabulary check sees the same tokens as in a target converted by that script.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from specdraft.core.io import atomic_write_json, read_json
from specdraft.model.loader import TOKENIZER_FILES, packed_weight_file
from specdraft.model.specs import (
    architecture_facts,
    load_config,
    text_config,
    tokenizer_from_dir,
    weight_file_problems,
    weight_files,
)
from specdraft.quant import q4g, qd4
from specdraft.quant.gguf import maps_to_q4_1, permute_rows, q4_1_blocks
from specdraft.quant.q4g import QuantizedTensor

GENERATION_CONFIG = "generation_config.json"
# Where a run's exports go, and the record beside each (a file: <out>.export.json; a dir: in it)
EXPORT_DIR = "export"
GGUF_RECORD_SUFFIX = ".export.json"
HF_RECORD = "export_record.json"
# What transformers' assisted generation reads from the assistant's own generation config
# (generation/candidate_generator.py). specdraft drafts a fixed number of tokens per step and never stops a
# draft early on its confidence (stages/speculate.py); a confidence threshold of 0 turns that stop off.
ASSISTED_GENERATION: dict[str, Any] = {
    "num_assistant_tokens": 4,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.0,
}
SCHEDULES = ("constant", "heuristic", "heuristic_transient")

GGUF_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}
GGUF_DTYPES = ("auto", "q4_1", "f16", "f32")
# convert_hf_to_gguf.py's tokenizer.ggml.pre detection: the sha256 of str(ids) of this text, encoded with the
# model's tokenizer, names its pre-tokenizer. The text and the few hashes below are llama.cpp's (MIT licence,
# get_vocab_base_pre); an unknown hash needs --tokenizer-pre, as it needs an update of that script.
_CHKTXT = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
           "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
           "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE "
           "you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
KNOWN_PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",     # HuggingFaceTB/SmolLM-135M
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",      # openai-community/gpt2
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",      # Qwen1.5 / Qwen3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",      # Qwen3-Embedding
}


# ------------------------------------------------------------------------------------------------ the source

@dataclass
class DraftSource:
    """A draft's weights as stored: q4g codes or raw tensors (a packed dir), float tensors (an HF dir)."""

    model_dir: Path
    kind: str                                                  # "qd4" | "hf"
    config: Any
    tensors: dict[str, QuantizedTensor | torch.Tensor]         # state-dict names, a tied weight once
    stored_as: dict[str, str]                                  # "q4g G=64", "f16", "float32", ...
    weight_files: list[Path]
    dropped: list[str] = field(default_factory=list)           # in the file, not in the model (ignored)

    def reference(self, name: str) -> torch.Tensor:
        """What ``load_draft(dir, "float32")`` holds for this tensor: the decoded value in float32."""
        t = self.tensors[name]
        return q4g.dequantize(t) if isinstance(t, QuantizedTensor) else t.to(torch.float32)


def read_source(model_dir: str | os.PathLike) -> DraftSource:
    """A packed dir (its QD04 file, checksum verified) or a plain HF dir (its safetensors, as saved)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a model dir (config.json is missing)")
    config = load_config(model_dir)
    expected = {n: tuple(t.shape) for n, t in qd4.stored_tensors(qd4.meta_model(config)).items()}
    weight = packed_weight_file(model_dir)
    if weight is not None:
        header, stored = qd4.read_qd4(weight, verify=True)
        tensors = dict(stored)
        stored_as = {e.name: f"q4g G={e.group_size}" if e.encoding == "q4g" else e.encoding for e in header.entries}
        kind, files = "qd4", [weight]
    else:
        problems = weight_file_problems(model_dir)
        if problems or not weight_files(model_dir):
            raise ValueError(f"{model_dir}: no usable weights "
                             f"({'; '.join(problems) or 'no draft.qd4 or *.safetensors'})")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        tensors = {n: t.detach() for n, t in qd4.stored_tensors(model).items()}
        stored_as = {n: qd4.dtype_name(t.dtype) for n, t in tensors.items()}
        kind, files = "hf", weight_files(model_dir)
    missing = [n for n in expected if n not in tensors]
    wrong = [f"{n}: {list(_shape(tensors[n]))} vs config {list(s)}" for n, s in expected.items()
             if n in tensors and _shape(tensors[n]) != s]
    if missing or wrong:
        raise ValueError(f"{files[0]}: weights do not fit {model_dir / 'config.json'}: "
                         + "; ".join([f"missing {n}" for n in missing] + wrong)[:2000])
    dropped = [n for n in tensors if n not in expected]
    for n in dropped:
        del tensors[n]
    return DraftSource(model_dir, kind, config, tensors, stored_as, files, dropped)


def _shape(t: QuantizedTensor | torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ------------------------------------------------------------------------------------------- GGUF: tensors

def llama_rope_row_order(rows: int, n_head: int) -> torch.Tensor:
    """The row order convert_hf_to_gguf's ``LlamaModel.permute`` gives a q or k projection: ``w[order]``.

    llama.cpp rotates adjacent pairs of a head's dimensions, transformers' llama the two halves of a head; the
    rows are reordered to match, a row permutation that moves whole q4g groups (and Q4_1 blocks)."""
    return torch.arange(rows).reshape(n_head, 2, rows // n_head // 2).transpose(1, 2).reshape(rows)


def _row_order(name: str, arch: str, facts: dict) -> torch.Tensor | None:
    if arch != "llama":
        return None
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return llama_rope_row_order(facts["heads"] * facts["head_dim"], facts["heads"])
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return llama_rope_row_order(facts["kv_heads"] * facts["head_dim"], facts["kv_heads"])
    return None


@dataclass
class GgufTensor:
    name: str                   # the state-dict name
    gguf_name: str
    data: np.ndarray
    qtype: gguf.GGMLQuantizationType
    record: dict[str, Any]      # what was written and whether it decodes to the loader's values exactly


def _encode(value: QuantizedTensor | torch.Tensor, dtype: str, keep_float32: bool
            ) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """One tensor's GGUF payload and type (docs/exports.md has the table). ``auto``: a q4g tensor as Q4_1 where
    its grid maps exactly, else F32 (its decoded values, exact); a float matrix in its own 16-bit type, F16 from
    float32 unless ``keep_float32`` (a QD04 f32 entry); vectors always F32, as llama.cpp's converter writes them."""
    T = gguf.GGMLQuantizationType
    if isinstance(value, QuantizedTensor):
        if dtype in ("auto", "q4_1") and maps_to_q4_1(value):
            return q4_1_blocks(value), T.Q4_1
        value = q4g.dequantize(value)
        keep_float32 = True
    if value.dim() < 2 or dtype == "f32":
        return value.to(torch.float32).numpy(), T.F32
    if dtype == "q4_1" and value.shape[1] % 32 == 0:  # rounded at G=32 by specdraft's own q4g minmax
        return q4_1_blocks(q4g.quantize(value, 32)), T.Q4_1
    if dtype == "auto" and value.dtype == torch.bfloat16:
        return value.contiguous().view(torch.int16).numpy().view(np.uint8), T.BF16
    if dtype == "auto" and value.dtype == torch.float32 and keep_float32:
        return value.numpy(), T.F32
    return value.to(torch.float16).numpy(), T.F16


def _decode(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    if qtype == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if qtype == gguf.GGMLQuantizationType.F16:
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))


def gguf_tensors(src: DraftSource, dtype: str = "auto") -> list[GgufTensor]:
    """Every tensor of the draft under its GGUF name, encoded, in the row order llama.cpp expects."""
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"gguf dtype must be one of {GGUF_DTYPES}, got {dtype!r}")
    arch = src.config.model_type
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{src.model_dir}: a {arch!r} model; the GGUF export writes {', '.join(GGUF_ARCHS)}")
    facts = architecture_facts(src.config)
    names = gguf.get_tensor_name_map(GGUF_ARCHS[arch], facts["layers"])
    out = []
    for name, value in src.tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{src.model_dir}: tensor {name} has no GGUF name for the {arch} architecture")
        order = _row_order(name, arch, facts)
        if order is not None:
            value = permute_rows(value, order) if isinstance(value, QuantizedTensor) else value[order]
        data, qtype = _encode(value, dtype, keep_float32=src.kind == "qd4")
        out.append(GgufTensor(name, gguf_name, data, qtype, _tensor_record(src, name, gguf_name, data, qtype, order)))
    return out


def _tensor_record(src: DraftSource, name: str, gguf_name: str, data: np.ndarray, qtype, order) -> dict[str, Any]:
    """Decode what is written (as a GGUF reader will) and compare it with the loader's values, in GGUF row order."""
    ref = src.reference(name)
    if order is not None:
        ref = ref[order]
    decoded = _decode(data, qtype).reshape(ref.shape)
    exact = _bits_equal(decoded, ref)
    rec = {"name": name, "gguf_name": gguf_name, "shape": list(_shape(src.tensors[name])),
           "stored_as": src.stored_as[name], "type": qtype.name, "exact": exact}
    if order is not None:
        rec["rows"] = "llama rope permutation (convert_hf_to_gguf LlamaModel.permute)"
    if not exact:
        rec["max_abs_error"] = _max_abs(decoded, ref)
    return rec


# ------------------------------------------------------------------------------------------- GGUF: metadata

def _file_type(tensors: list[GgufTensor]) -> int:
    """llama.cpp's general.file_type: the type most of the matrices' weights are in."""
    T, F = gguf.GGMLQuantizationType, gguf.LlamaFileType
    counts: dict[Any, int] = {}
    for t in tensors:
        if len(t.record["shape"]) == 2:
            counts[t.qtype] = counts.get(t.qtype, 0) + int(np.prod(t.record["shape"]))
    main = max(counts, key=counts.get) if counts else T.F32
    return {T.Q4_1: F.MOSTLY_Q4_1, T.F16: F.MOSTLY_F16, T.BF16: F.MOSTLY_BF16}.get(main, F.ALL_F32)


def _rope(text) -> tuple[float | None, str | None]:
    params = getattr(text, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    kind = params.get("rope_type") or (getattr(text, "rope_scaling", None) or {}).get("rope_type")
    return theta, kind


def _model_metadata(w: gguf.GGUFWriter, src: DraftSource, name: str, file_type: int) -> None:
    """The hyperparameters convert_hf_to_gguf writes for a llama / qwen3 model (TextModel.set_gguf_parameters,
    LlamaModel.set_gguf_parameters)."""
    text = text_config(src.config)
    theta, rope_type = _rope(text)
    if rope_type not in (None, "default"):
        raise ValueError(f"{src.model_dir}: rope type {rope_type!r} is not exported (llama.cpp needs its own "
                         "scaling keys for it)")
    facts = architecture_facts(src.config)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_block_count(facts["layers"])
    w.add_context_length(facts["max_positions"])
    w.add_embedding_length(facts["hidden"])
    w.add_feed_forward_length(facts["intermediate"])
    w.add_head_count(facts["heads"])
    w.add_head_count_kv(facts["kv_heads"])
    if theta is not None:
        w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(text.rms_norm_eps))
    if getattr(text, "head_dim", None) is not None:  # written only where the config declares it, as convert does
        w.add_key_length(facts["head_dim"])
        w.add_value_length(facts["head_dim"])
    w.add_file_type(file_type)
    if src.config.model_type == "llama":
        w.add_vocab_size(facts["vocab"])
        w.add_rope_dimension_count(facts["head_dim"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def tokenizer_pre(tokenizer, tokenizer_json: dict) -> tuple[str | None, str]:
    """(llama.cpp's tokenizer.ggml.pre name, how it was found), None when neither rule knows the tokenizer."""
    chkhsh = hashlib.sha256(str(tokenizer.encode(_CHKTXT)).encode()).hexdigest()
    if chkhsh in KNOWN_PRE_TOKENIZERS:
        return KNOWN_PRE_TOKENIZERS[chkhsh], f"convert_hf_to_gguf's hash of the test text ({chkhsh})"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        # a bare byte-level split is GPT-2's regex, which is llama.cpp's "gpt-2" pre-tokenizer
        return "gpt-2", f"the pre-tokenizer is GPT-2's byte-level regex (hash {chkhsh} not in llama.cpp's table)"
    return None, f"hash {chkhsh} is not in llama.cpp's table"


def _tokenizer_metadata(w: gguf.GGUFWriter, src: DraftSource, pre: str | None) -> dict[str, Any]:
    """tokenizer.ggml.* and the chat template, as convert_hf_to_gguf writes a GPT-2-style BPE tokenizer
    (``get_vocab_base``, ``_set_vocab_gpt2``, gguf-py's ``SpecialVocab``)."""
    model_dir, text = src.model_dir, text_config(src.config)
    tj_path = model_dir / "tokenizer.json"
    tj = json.loads(tj_path.read_text(encoding="utf-8")) if tj_path.is_file() else {}
    model = tj.get("model") or {}
    byte_level = any("ByteLevel" in json.dumps(tj.get(k)) for k in ("pre_tokenizer", "decoder"))
    if model.get("type") != "BPE" or not byte_level:
        raise ValueError(f"{model_dir}: the GGUF export writes GPT-2-style byte-level BPE tokenizers "
                         f"(tokenizer.json with a BPE model and ByteLevel pre-tokenizer/decoder); found "
                         f"{model.get('type') or 'no tokenizer.json'}")
    tokenizer = tokenizer_from_dir(model_dir)
    found, how = tokenizer_pre(tokenizer, tj)
    if pre is None and found is None:
        raise ValueError(f"{model_dir}: llama.cpp's pre-tokenizer for this tokenizer is unknown ({how}); name it "
                         "with --tokenizer-pre (the tokenizer.ggml.pre that convert_hf_to_gguf.py writes for the "
                         "target)")
    if pre is not None:
        how = "given (--tokenizer-pre)"
    pre = pre or found
    vocab_size = text.vocab_size
    reverse = {i: tok for tok, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    TT = gguf.TokenType
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TT.UNUSED)
            continue
        tok = reverse[i]
        if tok in added:
            if not decoder[i].normalized:
                tok = tokenizer.decode(tokenizer.encode(tok, add_special_tokens=False))
            if decoder[i].special or _looks_special(tok):
                types.append(TT.CONTROL)
            else:
                tok = tok.replace("\u2581", " ")
                types.append(TT.USER_DEFINED)
        else:
            types.append(TT.NORMAL)
        tokens.append(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(w, quiet=True)
    add_bos = special.add_special_token.get("bos")
    if src.config.model_type == "llama" and vocab_size == 49152:
        add_bos = False  # convert_hf_to_gguf's LlamaModel.set_vocab does this for this vocab size (SmolLM, Granite)
        w.add_add_bos_token(False)
    template = special.chat_template
    return {"model": "gpt2", "pre": pre, "pre_from": how, "tokens": len(tokens),
            "merges": len(special.merges), "special_token_ids": dict(special.special_token_ids),
            "add_bos_token": add_bos,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str)
            else None}


def _looks_special(tok: str) -> bool:
    """convert_hf_to_gguf's ``does_token_look_special`` for the tokens a byte-level BPE vocab has."""
    return (tok in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (tok.startswith("<|") and tok.endswith("|>"))
            or (tok.startswith("<｜") and tok.endswith("｜>")) or (tok.startswith("<unused") and tok.endswith(">")))


def write_gguf(src: DraftSource, out: str | os.PathLike, dtype: str = "auto", pre: str | None = None,
               name: str | None = None) -> dict[str, Any]:
    """Write the draft as one GGUF file at ``out``; return the record of what it holds (tensors, tokenizer)."""
    out = Path(out)
    tensors = gguf_tensors(src, dtype)
    arch = src.config.model_type
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[GGUF_ARCHS[arch]])
    _model_metadata(w, src, name or src.model_dir.name, _file_type(tensors))
    tokenizer = _tokenizer_metadata(w, src, pre)
    for t in tensors:
        w.add_tensor(t.gguf_name, t.data, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"architecture": gguf.MODEL_ARCH_NAMES[GGUF_ARCHS[arch]], "tensors": [t.record for t in tensors],
            "tokenizer": tokenizer, "file_type": gguf.LlamaFileType(_file_type(tensors)).name}


# --------------------------------------------------------------------------------------------- HF safetensors

HF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def draft_generation_config(base: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """``base`` (a target's or checkpoint's generation_config.json: eos / bos / pad ids kept) with the draft's
    assisted-generation settings: those ``base`` has, else ``ASSISTED_GENERATION``'s; ``settings`` not None win."""
    unknown = set(settings) - set(ASSISTED_GENERATION)
    if unknown:
        raise ValueError(f"not assisted-generation settings: {sorted(unknown)}")
    merged = {**ASSISTED_GENERATION, **{k: base[k] for k in ASSISTED_GENERATION if k in base},
              **{k: v for k, v in settings.items() if v is not None}}
    if merged["num_assistant_tokens_schedule"] not in SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule must be one of {SCHEDULES}")
    if int(merged["num_assistant_tokens"]) < 1 or not 0 <= float(merged["assistant_confidence_threshold"]) < 1:
        raise ValueError("num_assistant_tokens must be >= 1 and assistant_confidence_threshold in [0, 1)")
    return {**base, **merged}


def source_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / GENERATION_CONFIG
    return read_json(path) if path.is_file() else {}


def write_hf(src: DraftSource, out: str | os.PathLike, dtype: str = "bfloat16",
             generation: dict[str, Any] | None = None) -> dict[str, Any]:
    """A plain transformers dir in ``out`` (which must exist, empty): model.safetensors in ``dtype``, config,
    tokenizer files and a generation_config.json with the draft's assisted-generation settings."""
    if dtype not in HF_DTYPES:
        raise ValueError(f"hf dtype must be one of {tuple(HF_DTYPES)}, got {dtype!r}")
    out = Path(out)
    torch_dtype = HF_DTYPES[dtype]
    state, records = {}, []
    for name in src.tensors:
        ref = src.reference(name)
        state[name] = ref.to(torch_dtype).contiguous()
        back = state[name].to(torch.float32)
        exact = _bits_equal(back, ref)
        records.append({"name": name, "shape": list(ref.shape), "stored_as": src.stored_as[name], "type": dtype,
                        "exact": exact, **({} if exact else {"max_abs_error": _max_abs(back, ref)})})
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = load_config(src.model_dir)
    config.dtype = torch_dtype
    config.save_pretrained(out)
    copied = [n for n in TOKENIZER_FILES if (src.model_dir / n).is_file()]
    if not copied:
        raise ValueError(f"{src.model_dir}: no tokenizer files (expected some of {', '.join(TOKENIZER_FILES)})")
    for n in copied:
        shutil.copy2(src.model_dir / n, out / n)
    gen = draft_generation_config(source_generation_config(src.model_dir), **(generation or {}))
    atomic_write_json(out / GENERATION_CONFIG, gen)
    return {"tensors": records, "tokenizer_files": copied,
            "generation_config": {k: gen[k] for k in ASSISTED_GENERATION}}
