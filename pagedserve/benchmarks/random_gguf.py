"""GGUF files with random weights in a real model's shape, for speed comparisons.

A benchmark at the 1-8B sizes people chat with needs those shapes, not those weights:
`ensure_random_gguf("Q4_0")` writes (once, cached) a llama-architecture GGUF in
SmolLM2-1.7B's shape with SmolLM2's tokenizer and chat template (copied from the
default model's file), every linear and the (tied) embedding in the requested block
format with random quants and a fixed scale, norms at one.  llama.cpp and pagedserve
then read the very same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedserve.model_loader.sources import cache_dir


@dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 49152
    context: int = 8192
    rope_theta: float = 130000.0


SMOLLM2_1_7B = LlamaShape("smollm2-1.7b-shape", hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192)

# type -> (GGML type id, general.file_type, bytes per block of 32 weights)
_FORMATS = {"Q8_0": (8, 7, 34), "Q4_0": (2, 2, 18), "Q4_1": (3, 3, 20)}
_TEMPLATE_MODEL = "smollm2-135m-instruct"


def _random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 * block bytes] uint8: random codes, scales giving |w| of about 0.02-0.05."""
    _, _, nbytes = _FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 32, nbytes), dtype=np.uint8)
    d = {"Q8_0": 0.04 / 127, "Q4_0": 0.04 / 8, "Q4_1": 0.08 / 15}[qtype]
    blocks[..., 0:2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if qtype == "Q4_1":
        blocks[..., 2:4] = np.frombuffer(np.float16(-0.04).tobytes(), dtype=np.uint8)  # the minimum
    return blocks.reshape(rows, -1)


def ensure_random_gguf(qtype: str, shape: LlamaShape = SMOLLM2_1_7B, seed: int = 0) -> str:
    """The path of the cached random GGUF (`qtype` in Q8_0, Q4_0, Q4_1); writes it first if needed."""
    import gguf

    from pagedserve.model_loader.sources import MODEL_NAMES, ensure_converted

    if qtype not in _FORMATS:
        raise ValueError(f"qtype must be one of {', '.join(_FORMATS)}, got {qtype!r}")
    out = Path(cache_dir()) / "random-gguf" / f"{shape.name}-{qtype}-seed{seed}.gguf"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    source = MODEL_NAMES[_TEMPLATE_MODEL]
    template = gguf.GGUFReader(os.path.join(ensure_converted(source), os.path.basename(source.gguf_member)))
    arch = "llama"
    writer = gguf.GGUFWriter(str(out) + ".tmp", arch)
    for key, field in template.fields.items():
        if key.startswith("tokenizer.") or key == "general.quantization_version":
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)
    writer.add_name(f"random {shape.name} {qtype}")
    writer.add_file_type(_FORMATS[qtype][1])
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    rng = np.random.default_rng(seed)
    raw = gguf.GGMLQuantizationType[qtype]
    head_dim = shape.hidden // shape.heads

    def linear(name: str, out_features: int, in_features: int) -> None:
        writer.add_tensor(name, _random_blocks(out_features, in_features, qtype, rng), raw_dtype=raw)

    linear("token_embd.weight", shape.vocab, shape.hidden)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, dtype=np.float32))
    for i in range(shape.layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(shape.hidden, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(shape.hidden, dtype=np.float32))
        linear(p + "attn_q.weight", shape.heads * head_dim, shape.hidden)
        linear(p + "attn_k.weight", shape.kv_heads * head_dim, shape.hidden)
        linear(p + "attn_v.weight", shape.kv_heads * head_dim, shape.hidden)
        linear(p + "attn_output.weight", shape.hidden, shape.heads * head_dim)
        linear(p + "ffn_gate.weight", shape.intermediate, shape.hidden)
        linear(p + "ffn_up.weight", shape.intermediate, shape.hidden)
        linear(p + "ffn_down.weight", shape.hidden, shape.intermediate)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".tmp", out)
    return str(out)


if __name__ == "__main__":
    import sys

    for q in sys.argv[1:] or ["Q4_0", "Q8_0"]:
        print(ensure_random_gguf(q))
