"""Reading llama.cpp GGUF files: metadata -> HF config, quantized tensors -> HF-named float
tensors, or kept quantized (BlockWeights) for the CPU's quantized layers.

Weights are dequantized to float32 with the `gguf` package, renamed from llama.cpp's
scheme (blk.N.attn_q, ...) to HF's (model.layers.N.self_attn.q_proj, ...), and for the
llama architecture the Q/K rows are put back in HF order: llama.cpp's converter
interleaves each head's two rotary halves for its "normal" RoPE kernel, while our RoPE
(like HF's) rotates halves.  After that the model code cannot tell a GGUF from a
safetensors checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.layers.quantization import BlockWeights, from_gguf

# llama.cpp architecture -> (HF model_type, HF architecture)
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms per layer: llama.cpp's ffn_norm is the norm before its MLP.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp's gemma3 converter stores every RMSNorm weight as 1 + w (its norm multiplies
# by the weight as is); HF's Gemma3RMSNorm, and ours, scale by (1 + w).
_NORM_SHIFT = {"gemma3": 1.0}
# What llama.cpp assumes for gemma3 and does not store: every 6th layer global, the
# sliding layers' RoPE base.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_ROPE_THETA = 6, 10000.0
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


GGML_MAX_DIMS = 4  # (llama.cpp's bound on a tensor's dimensions)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: `data` is a read-only view into the mapped file (raw
    block bytes [rows, bytes per row] for quantized types, typed values for float ones)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    n_elements: int
    data: np.ndarray


@dataclass
class GGUFFile:
    """What pagedserve needs of a GGUF: scalar metadata (arrays by their length only) and
    the tensor index over a memory map.  gguf's own GGUFReader also decodes every string
    of the embedded vocabulary (4 s for SmolLM2's 49,152 tokens); this skips them."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _scalar(vtype: int, key: str) -> str:
    """The struct format of a metadata scalar type (GGUF defines 0-12; an array of arrays
    is not read here), or a ValueError naming the key ("KeyError: 77" said nothing)."""
    if vtype not in _SCALARS:
        raise ValueError(f"metadata {key[:100]!r} has value type {vtype}, which is not a GGUF scalar type")
    return _SCALARS[vtype]


# The most strings one metadata array may hold (16x Gemma 3's 262,144-token vocabulary):
# each is skipped by a Python step, and a crafted header's count (2^62, over zeros in a
# sparse file) kept a server's event loop busy for 22 s reading it.
MAX_GGUF_ARRAY_STRINGS = 1 << 22


class _Cursor:
    """A read position in a GGUF's bytes; every length the header claims is checked
    against what is left of the file (ValueError), before anything is skipped or read."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        import struct

        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def room(self, n: int, what: str) -> int:
        if n > len(self.buf) - self.pos:
            raise ValueError(f"{what} of {n} bytes runs past the end of the file")
        return n

    def string(self) -> str:
        n = self.room(self.take("<Q"), "a string")
        self.pos += n
        return bytes(self.buf[self.pos - n: self.pos]).decode("utf-8", errors="replace")

    def skip_array(self, key: str) -> int:
        """Past an array's values (only their count is kept)."""
        import struct

        etype, count = self.take("<I"), self.take("<Q")
        if etype != _STRING:
            self.pos += self.room(count * struct.calcsize(_scalar(etype, key)), f"{key!r}'s {count} values")
            return count
        if count > MAX_GGUF_ARRAY_STRINGS:
            raise ValueError(f"{key!r} holds {count} strings, more than {MAX_GGUF_ARRAY_STRINGS}")
        self.room(count * 8, f"{key!r}'s {count} strings")
        for _ in range(count):
            n = self.take("<Q")  # (not `pos += take(...)`: take moves pos itself)
            self.pos += self.room(n, "a string")
        return count


class ArrayLength(int):
    """A metadata array's length (its values are not read): not a scalar key's value."""


def _read_gguf(path: str) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError("bad magic")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (this reader handles v2 and v3)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    cur.room(n_tensors * 24 + n_kv * 12, f"{n_tensors} tensors' and {n_kv} keys' headers")  # (their least sizes)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("<I")
        if vtype == _ARRAY:
            metadata[key] = ArrayLength(cur.skip_array(key))  # arrays: only their length is needed here
        elif vtype == _STRING:
            metadata[key] = cur.string()
        else:
            metadata[key] = cur.take(_scalar(vtype, key))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("<I")
        if n_dims > GGML_MAX_DIMS:  # (the file's bytes read as dimensions: work and memory grew with its size)
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have at most {GGML_MAX_DIMS}")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        type_id = cur.take("<I")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} has ggml type {type_id}, which the gguf package here does not "
                             "know") from None
        infos.append((name, dims, qtype, cur.take("<Q")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment is {align!r}; it must be a power of two")
    data_start = -(-cur.pos // align) * align
    end = 0  # (in offset order: each aligned, none overlapping the one before, as llama.cpp checks)
    for name, dims, qtype, offset in sorted(infos, key=lambda info: info[3]):
        if offset % align or offset < end:
            raise ValueError(f"tensor {name!r} starts at data offset {offset}, "
                             + (f"not a multiple of the alignment {align}" if offset % align
                                else f"inside the tensor before it (which ends at {end})"))
        block, nbytes = GGML_QUANT_SIZES[qtype]
        end = offset + math.prod(dims) // block * nbytes
    tensors = []
    # Plain-ndarray views of the mapping (it stays alive through their base): numpy.memmap's
    # subclass hooks on each slice were half of gguf's dequantization time (Gemma 3 270M's
    # 268M weights: 3.8 s through memmaps, 1.8 s through plain views; Zen 3, AVX2 only).
    whole = mm.view(np.ndarray)
    for name, dims, qtype, offset in infos:
        n = math.prod(dims)  # (np.prod wrapped at 2**63: declared dims that overflowed read as small ones)
        block, nbytes = GGML_QUANT_SIZES[qtype]
        size = n // block * nbytes
        raw = whole[data_start + offset: data_start + offset + size]
        if len(raw) != size:
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        if qtype.name in ("F32", "F16"):
            data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(tuple(reversed(dims)))
        else:
            data = raw.reshape(n // dims[0], -1) if dims else raw
        tensors.append(GGUFTensor(name, qtype, dims, n, data))
    return GGUFFile(metadata, tensors)


def open_gguf(path: str) -> GGUFFile:
    """The GGUF at `path`, or a ValueError naming the file when it is not a readable GGUF."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return _read_gguf(path)
    except Exception as e:  # assorted errors on garbage and truncation
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.metadata.get(key)
    return default if value is None else value


def gguf_to_hf_config(reader: GGUFFile, path: str) -> Any:
    """A transformers PretrainedConfig from the file's metadata (llama, qwen2, qwen3, gemma3)."""
    from transformers import AutoConfig

    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    model_type, architecture = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if isinstance(value, ArrayLength):  # (llama.cpp takes per-layer arrays for some keys)
            raise ValueError(f"{path}: GGUF key {arch}.{key} holds an array (a value per layer?); pagedserve "
                             "reads one value for every layer")
        return value

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    if heads is None or hidden is None or meta("block_count") is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.attention.head_count/embedding_length/block_count")
    kwargs: dict[str, Any] = dict(
        architectures=[architecture],
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("attention.key_length", hidden // heads),
        max_position_embeddings=meta("context_length", 2048),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        vocab_size=meta("vocab_size") or _field(reader, "tokenizer.ggml.tokens"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    scaling = _gguf_rope_scaling(meta, path)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    freq_factors = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freq_factors is not None:
        # Llama 3.1's scaling, as llama.cpp's converter stores it: each rotary frequency is
        # divided by its factor (RotaryEmbedding's freq_factors).
        kwargs["rope_freq_factors"] = [float(x) for x in np.asarray(freq_factors.data, dtype=np.float32).ravel()]
    rotated = meta("rope.dimension_count")
    if rotated is not None and rotated != kwargs["head_dim"]:
        raise ValueError(f"{path}: GGUF {arch}.rope.dimension_count={rotated} rotates part of each head of "
                         f"{kwargs['head_dim']}; partial rotary embeddings are not supported")
    if any("ffn_gate_inp" in n for n in tensor_names):
        raise ValueError(f"{path}: a mixture-of-experts GGUF (ffn_gate_inp: expert routing) of architecture "
                         f"{arch!r}; GGUF files of mixture-of-experts models are not supported")
    if arch == "qwen2" or any(n.endswith("attn_q.bias") for n in tensor_names):
        kwargs["attention_bias"] = True
    if arch == "gemma3":
        kwargs.update(_gemma3_config(meta, kwargs, path))
    return AutoConfig.for_model(model_type, **kwargs)


def _gemma3_config(meta: Any, kwargs: dict[str, Any], path: str) -> dict[str, Any]:
    """Gemma 3's fields, as llama.cpp reads the file: the window from the metadata, the
    layer pattern and local RoPE base it hard-codes, the final logits' soft cap where the
    file has one, and the attention scale: 1/sqrt(head_dim), but for the 27B model (its 62
    layers) 1/sqrt(hidden / heads), as Google's config says (query_pre_attn_scalar 168,
    where head_dim is 128)."""
    window = meta("attention.sliding_window")
    if window is None:
        raise ValueError(f"{path}: GGUF gemma3 metadata lacks gemma3.attention.sliding_window")
    n = kwargs["num_hidden_layers"]
    full = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    full.update(kwargs.pop("rope_scaling", None) or {})
    scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"] if n == 62 else kwargs["head_dim"]
    cap = meta("final_logit_softcapping")
    return dict(
        final_logit_softcapping=float(cap) if cap else None,
        sliding_window=int(window), query_pre_attn_scalar=scalar,
        layer_types=["full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(n)],
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA}},
    )


# llama.cpp's per-dimension rope frequency divisors (Llama 3.1's scaling, precomputed).
ROPE_FREQS = "rope_freqs.weight"
# YaRN keys llama.cpp may write whose effect pagedserve does not implement: refused when
# present with a value other than the neutral one.
_YARN_UNSUPPORTED = {"rope.scaling.attn_factor": 1.0, "rope.scaling.yarn_attn_factor": 1.0,
                     "rope.scaling.yarn_ext_factor": None, "rope.scaling.yarn_log_multiplier": 0.0}


def _gguf_rope_scaling(meta: Any, path: str) -> dict[str, Any] | None:
    """The HF rope_scaling dict for the file's rope.scaling.* metadata (none, linear, yarn)."""
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn":
        raise ValueError(f"{path}: unsupported GGUF rope scaling {kind!r} (supported: linear, yarn)")
    original = meta("rope.scaling.original_context_length")
    if factor is None or original is None:
        raise ValueError(f"{path}: GGUF yarn rope scaling needs rope.scaling.factor and "
                         "rope.scaling.original_context_length")
    for key, neutral in _YARN_UNSUPPORTED.items():
        value = meta(key)
        if value is not None and (neutral is None or float(value) != neutral):
            raise ValueError(f"{path}: GGUF yarn setting {key} = {value} is not supported")
    out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if meta(key) is not None:
            out[name] = float(meta(key))
    return out


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the two rotary halves (rows of q/k weight or bias)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_block_rows(w: BlockWeights, n_head: int) -> BlockWeights:
    """`_unpermute_rows` for quantized rows: every row keeps its blocks, so moving rows is lossless."""
    order = torch.from_numpy(_unpermute_rows(np.arange(w.shape[0]), n_head).copy())
    return BlockWeights(w.kind, w.codes.index_select(0, order), w.d.index_select(0, order),
                        None if w.m is None else w.m.index_select(0, order), w.source_type)


def gguf_hf_name(name: str, arch: str = "llama") -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def iter_gguf_tensors(reader: GGUFFile, hf_config: Any, path: str,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | BlockWeights]]:
    """(HF name, float32 tensor) for every tensor in the file; unknown tensors are a ValueError.
    With `keep_quantized`, quantized matrices come as BlockWeights instead (layers/quantization.py)."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    permute = arch == "llama"
    norm_shift = _NORM_SHIFT.get(arch)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # read into the config (rope_freq_factors), not a weight
        name = gguf_hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"{path}: GGUF tensor {tensor.name!r} has no counterpart in the model")
        if keep_quantized and len(tensor.shape) == 2:
            k = int(tensor.shape[0])  # GGUF lists dimensions innermost first
            try:
                blocks = from_gguf(tensor.data, tensor.tensor_type.name, (int(tensor.n_elements) // k, k))
            except Exception as e:
                raise ValueError(f"{path}: cannot read {tensor.name!r} ({tensor.tensor_type.name}): "
                                 f"{type(e).__name__}: {e}") from None
            if blocks is not None:
                if permute and ".q_proj." in name:
                    blocks = _unpermute_block_rows(blocks, hf_config.num_attention_heads)
                elif permute and ".k_proj." in name:
                    blocks = _unpermute_block_rows(blocks, hf_config.num_key_value_heads)
                yield name, blocks
                continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize {tensor.name!r} "
                             f"({tensor.tensor_type.name}): {type(e).__name__}: {e}") from None
        w = np.asarray(w, dtype=np.float32)
        if not (w.flags.writeable and w.flags.c_contiguous):  # F32 tensors come back as read-only views of the mapping
            w = np.array(w, dtype=np.float32)
        if permute and ".q_proj." in name:
            w = _unpermute_rows(w, hf_config.num_attention_heads)
        elif permute and ".k_proj." in name:
            w = _unpermute_rows(w, hf_config.num_key_value_heads)
        if norm_shift is not None and name.endswith("norm.weight"):
            w = w - np.float32(norm_shift)
        yield name, torch.from_numpy(np.ascontiguousarray(w))


def gguf_tokenizer_class(model_type: str) -> Any:
    """The tokenizer class AutoTokenizer picks for a GGUF of this model type (with no
    tokenizer config beside it): transformers' registered class for the type, else its
    generic `TokenizersBackend` (llama's case).  transformers 4.x (no such backend, another
    table): AutoTokenizer itself, which then reads the whole file first."""
    try:
        from transformers import TokenizersBackend
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    found = tokenizer_class_from_name(name) if name else None
    return found if found is not None else TokenizersBackend


def load_gguf_tokenizer(path: str, reader: GGUFFile | None = None) -> Any:
    """The tokenizer and chat template embedded in the GGUF, converted by transformers.

    Not through AutoTokenizer: to pick the class it first rebuilds the model's config with
    gguf's GGUFReader, which decodes every vocabulary string (about 15 s for Gemma 3's 262k
    tokens, 5 s for SmolLM2's 49k, real Zen 3), only to learn the model type.  The type
    comes from our own header read instead; the conversion itself is transformers' own
    (`tests/model_loader/test_gguf_tokenizer.py` checks the saved files are AutoTokenizer's).
    `reader`: the file's, where the caller has read it already."""
    def fail(why: str) -> ValueError:
        return ValueError(f"{path}: cannot build a tokenizer from the GGUF ({why})")

    try:
        reader = reader or open_gguf(path)
    except Exception as e:
        raise fail(f"{type(e).__name__}: {e}") from None
    kind = _field(reader, "tokenizer.ggml.model")
    needed = ["tokenizer.ggml.model", "tokenizer.ggml.tokens"] + (["tokenizer.ggml.merges"] if kind == "gpt2" else [])
    missing = [key for key in needed if _field(reader, key) is None]
    if missing:  # (transformers' conversion said only "KeyError: 'tokens'")
        raise fail(f"it has no {', '.join(missing)}; name a tokenizer with --tokenizer")
    try:
        arch = _field(reader, "general.architecture")
        model_type = GGUF_ARCHITECTURES[arch][0] if arch in GGUF_ARCHITECTURES else str(arch)
        with _alone(path) as (folder, name):
            return gguf_tokenizer_class(model_type).from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise fail(f"{type(e).__name__}: {e}") from None


@contextlib.contextmanager
def _alone(path: str) -> Iterator[tuple[str, str]]:
    """(folder, file name) naming the GGUF file in a folder of its own: transformers reads
    a folder's tokenizer_config.json and chat_template.jinja beside a gguf_file, so a GGUF
    next to other tokenizer files (a converted model's, an HF checkout's) lost its own chat
    template to theirs (to none, beside a registered model's conversion).  A link where the
    file system makes one, else the file's own folder."""
    path = os.path.abspath(path)
    with tempfile.TemporaryDirectory(prefix="pagedserve-gguf-") as folder:
        link = os.path.join(folder, os.path.basename(path))
        try:
            os.symlink(path, link)
        except OSError:
            yield os.path.dirname(path), os.path.basename(path)
            return
        yield folder, os.path.basename(path)
