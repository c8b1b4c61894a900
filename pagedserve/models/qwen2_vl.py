"""Qwen2-VL and Qwen2.5-VL: a dynamic-resolution vision transformer whose patch merger
feeds image rows into a Qwen2 decoder that rotates with M-RoPE.

The vision tower runs plain torch modules (no tensor parallelism: it is a few percent
of the model and runs once per image).  Each image is a grid of `patch_size` patches
(pixel_values rows, in 2x2 merge-block order as the HF image processor lays them out);
blocks attend within an image (Qwen2-VL; Qwen2.5-VL's `fullatt_block_indexes`) or
within windows of `window_size` pixels (Qwen2.5-VL's other blocks), and the merger
folds each spatial_merge_size**2 block of patches into one decoder row.

The decoder is our Llama/Qwen2 layer stack unchanged: M-RoPE only changes which
position each rotary frequency reads (time, height or width stream, by
`mrope_section`), so `MRotaryEmbedding.cos_sin` builds per-token (cos, sin) in the
layout every layer (and the fused kernels) already take.

The math follows transformers' modeling_qwen2_vl.py / modeling_qwen2_5_vl.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.rotary_embedding import RotaryEmbedding, on_the_host_under_meta, rope_config
from pagedserve.models.llama import AttentionFlags, LlamaForCausalLM, LlamaModel, head_dim_of
from pagedserve.models.utils import StackedMapping, load_named_weights, load_plain_weights

# ----------------------------------------------------------------------------- text side


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE: positions [3, T] (time, height, width); rotary frequency j reads
    the stream its `mrope_section` chunk names (chunks cycle t, h, w).  For text tokens
    the three streams are equal and this is the plain rotary.

    The table is the parent's (the same float32 products, cast once), so a token's
    cos/sin equal HF's per-forward computation exactly."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict,
                 mrope_section: list[int]) -> None:
        super().__init__(head_dim, head_dim, max_position, theta, scaling)
        half = head_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} sums to {sum(mrope_section)}, not head_dim/2 = {half}")
        self.mrope_section = list(mrope_section)
        with on_the_host_under_meta():
            stream = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)])
        # One stream per table column: the cos half and the sin half alike.
        self.register_buffer("stream_index", torch.cat([stream, stream]).to(torch.get_default_device()),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (or [T]: text, all streams equal) -> per-token (cos, signed
        sin), each [T, 1, R], as RotaryEmbedding.cos_sin."""
        if positions.dim() == 1:
            return super().cos_sin(positions)
        t, r = positions.shape[1], self.rotary_dim
        streams = self.cos_sin_cache[positions]  # [3, T, R]
        picked = streams.gather(0, self.stream_index.view(1, 1, r).expand(1, t, r))[0]
        cos, sin = picked.chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}"


def make_mrope(text_config: Any) -> MRotaryEmbedding:
    theta, scaling = rope_config(text_config)
    section = scaling.get("mrope_section")
    if not section:
        raise ValueError("the text config's rope_parameters (rope_scaling) has no mrope_section; Qwen2-VL's "
                         "decoder needs it")
    max_position = int(getattr(text_config, "max_position_embeddings", None) or 32768)
    return MRotaryEmbedding(head_dim_of(text_config), max_position, theta, scaling, list(section))


# ----------------------------------------------------------------------------- vision side


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def vision_rope_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w) of every patch, [N, 2], in the processor's row order: merge-blocks in
    raster order, the patches of a block in raster order inside it; frames repeat."""
    out = []
    for t, h, w in grid_thw.tolist():
        hpos = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        wpos = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hw = torch.stack([hpos.transpose(1, 2).flatten(), wpos.transpose(1, 2).flatten()], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> list[int]:
    """Boundaries of full attention: each frame of each image attends within itself."""
    bounds = [0]
    for t, h, w in grid_thw.tolist():
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_index(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merge-block order that lists each window's blocks
    together (windows of `window` x `window` merged rows, in raster order, cut short at
    the image's bottom/right edge), and the patch boundaries of the windows in it."""
    order: list[torch.Tensor] = []
    bounds = [0]
    base = 0
    unit = merge * merge
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in range(t):
            for top in range(0, gh, window):
                for left in range(0, gw, window):
                    block = index[frame, top:top + window, left:left + window].flatten()
                    order.append(block + base)
                    bounds.append(bounds[-1] + block.numel() * unit)
        base += t * gh * gw
    return torch.cat(order), bounds


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                      scale: float) -> torch.Tensor:
    """Non-causal attention within each [bounds[i], bounds[i+1]) segment; q, k, v
    [N, H, D] -> [N, H, D].  Segments of one length run as one batched call (windows
    are mostly the same size), which is the same math as one call per segment."""
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    for length, starts in by_length.items():
        rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        n = len(starts)
        qs, ks, vs = (x.index_select(0, rows).view(n, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(n * length, *q.shape[1:]))
    return out


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rope  # [N, 1, D] float32: HF rotates in float32 and casts back
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        o = segment_attention(q, k, v, bounds, self.head_dim**-0.5)
        return self.proj(o.reshape(n, -1))


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def vision_activation(name: str) -> nn.Module:
    """The vision MLP's activation by HF name; others are refused rather than replaced."""
    acts: dict[str, nn.Module] = {
        "quick_gelu": QuickGELU(), "gelu": nn.GELU(), "gelu_pytorch_tanh": nn.GELU(approximate="tanh"),
        "silu": nn.SiLU(),
    }
    if name not in acts:
        raise ValueError(f"unsupported vision hidden_act {name!r}; supported: {', '.join(sorted(acts))}")
    return acts[name]


class VisionMlp(nn.Module):
    """Qwen2-VL: fc1 -> activation -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = vision_activation(act)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL: SwiGLU with bias."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, rms: bool) -> None:
        super().__init__()
        self.norm1: nn.Module = RMSNorm(dim, eps=1e-6) if rms else nn.LayerNorm(dim, eps=1e-6)
        self.norm2: nn.Module = RMSNorm(dim, eps=1e-6) if rms else nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm each patch, then one MLP over each merge-block's concatenated patches."""

    def __init__(self, out_dim: int, dim: int, merge: int, rms: bool) -> None:
        super().__init__()
        self.hidden_size = dim * merge * merge
        self.ln_q: nn.Module = RMSNorm(dim, eps=1e-6) if rms else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class PatchEmbed(nn.Module):
    """Conv3d whose kernel is the whole patch: one matmul over the flattened patch (the
    weight keeps the checkpoint's Conv3d shape).  The same products as HF's Conv3d,
    summed in another order (last-bit differences), at 3-4x the speed on CPU (2000
    patches 1176 -> 1280: 0.8 s instead of 2.9 s in bfloat16 on 2 cores)."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=(temporal_patch_size, patch_size, patch_size),
                              stride=(temporal_patch_size, patch_size, patch_size), bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))


class VisionTransformer(nn.Module):
    """Both families' vision tower; `windowed` is Qwen2.5-VL (RMSNorm, SwiGLU, window
    attention outside fullatt_block_indexes)."""

    def __init__(self, config: Any, windowed: bool) -> None:
        super().__init__()
        self.windowed = windowed
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        if windowed:
            dim, out_dim = int(config.hidden_size), int(config.out_hidden_size)
            self.fullatt_blocks = {int(i) for i in config.fullatt_block_indexes}
            self.window = int(config.window_size) // self.merge // self.patch_size
            if self.window < 1:
                raise ValueError(f"window_size {config.window_size} is smaller than one merged patch "
                                 f"({self.merge * self.patch_size} pixels)")

            def mlp() -> nn.Module:
                return VisionGatedMlp(dim, int(config.intermediate_size), config.hidden_act)
        else:
            dim, out_dim = int(config.embed_dim), int(config.hidden_size)

            def mlp() -> nn.Module:
                return VisionMlp(dim, int(dim * config.mlp_ratio), config.hidden_act)
        num_heads = int(config.num_heads)
        head_dim = dim // num_heads
        self.patch_embed = PatchEmbed(self.patch_size, int(config.temporal_patch_size), int(config.in_channels), dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, num_heads, mlp(), windowed) for _ in range(config.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, windowed)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"unsupported vision rope_type {rope.get('rope_type')!r}; Qwen2-VL's is 'axial'")
        theta = float(rope.get("rope_theta", 10000.0))
        spatial = head_dim // 2
        with on_the_host_under_meta():
            freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)
        self.register_buffer("inv_freq", freq.to(torch.get_default_device()), persistent=False)

    def _rope(self, grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-patch (cos, sin) [N, 1, head_dim] in float32: h's frequencies then w's, twice."""
        pos = vision_rope_positions(grid_thw, self.merge).to(device)
        freqs = (pos[..., None].float() * self.inv_freq.float()).flatten(1)  # [N, head_dim/2]
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None]
        return freqs.cos(), freqs.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches of all images [N, C*T*P*P] + their grids [n, 3] -> merged rows [N / merge**2, out_dim]."""
        x = self.patch_embed(pixel_values)
        cos, sin = self._rope(grid_thw, x.device)
        full = frame_cu_seqlens(grid_thw)
        order = None
        windows = full
        if self.windowed:
            order, windows = window_index(grid_thw, self.merge, self.window)
            order = order.to(x.device)
            unit = self.merge * self.merge

            def permute(t: torch.Tensor) -> torch.Tensor:
                return t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1)

            x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            bounds = full if not self.windowed or i in self.fullatt_blocks else windows
            x = block(x, (cos, sin), bounds)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged


# ----------------------------------------------------------------------------- the model


class Qwen2VLForConditionalGeneration(nn.Module):
    """Qwen2-VL: the vision tower + the Qwen2 decoder with M-RoPE (SupportsImages)."""

    uses_mrope: ClassVar[bool] = True
    bidirectional_image_attention: ClassVar[bool] = False
    windowed_vision: ClassVar[bool] = False
    stacked_params: StackedMapping = LlamaForCausalLM.stacked_params

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        text = config.text_config
        self.text_config = text
        self._check_text_config(text)
        self.image_token_id = int(config.image_token_id)
        self.visual = VisionTransformer(config.vision_config, self.windowed_vision)
        self.model = LlamaModel(text, AttentionFlags(qkv_bias=True, o_bias=False))
        # M-RoPE in place of the plain rotary: one table shared by every layer.
        mrope = make_mrope(text)
        self.model.rotary_emb = mrope
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = mrope
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)
                                        or getattr(text, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tied_to=tied)

    @staticmethod
    def _check_text_config(text: Any) -> None:
        """Refuse by name what HF's decoder computes and ours would not."""
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None)
        if head_dim and int(head_dim) * heads != int(text.hidden_size):
            raise ValueError(f"text head_dim {head_dim} differs from hidden_size/num_attention_heads "
                             f"({text.hidden_size}/{heads}), which is what Qwen2-VL's attention uses")
        if "sliding_attention" in (getattr(text, "layer_types", None) or []):
            raise ValueError("the text config has sliding-window layers (use_sliding_window); not implemented "
                             "for Qwen2-VL here")
        act = getattr(text, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported text hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")

    # SupportsImages

    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """All images through the tower at once (attention never crosses an image), then
        split: image i's [grid_t*grid_h*grid_w / merge**2, hidden] rows."""
        if not images:
            return []
        device = self.model.embed_tokens.weight.device
        dtype = self.model.embed_tokens.weight.dtype
        pixels = torch.cat([im["pixel_values"] for im in images]).to(device)
        grids = torch.cat([im["image_grid_thw"].reshape(-1, 3) for im in images]).to(torch.long)
        merged = self.visual(pixels, grids).to(dtype)
        sizes = (grids.prod(-1) // self.visual.merge**2).tolist()
        return list(merged.split(sizes))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [3, T] (M-RoPE streams; [T] for text alone) -> hidden [T, hidden];
        `inputs_embeds` (image rows put in) replaces the ids' embeddings when given.  The
        decoder's rotary is MRotaryEmbedding, so LlamaModel's cos_sin gather takes [3, T]."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    # Weights

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Either naming to ours: transformers 5's module names (model.language_model.*,
        model.visual.*) or the hub checkpoints' (model.*, visual.*), which is also what
        transformers 5.24's save_pretrained writes."""
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        if name.startswith("model.visual."):
            return name[len("model."):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named (name, tensor) pairs -> parameters.  The decoder's go through the fused
        projections' loaders; the tower's are plain copies (its Qwen2.5-VL MLP has
        gate_proj/up_proj names that must not be fused).  ValueError names any missing or
        stray tensor of either."""
        vision: list[tuple[str, torch.Tensor]] = []

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for original, tensor in weights:
                name = self.checkpoint_name(original)
                if "rotary_emb.inv_freq" in name or "rotary_pos_emb.inv_freq" in name:
                    continue
                if name.startswith("visual."):
                    vision.append((name[len("visual."):], tensor))
                    continue
                yield name, tensor

        text_part = nn.Module()
        text_part.model = self.model
        text_part.lm_head = self.lm_head
        tied = self.tie_word_embeddings
        used = load_named_weights(text_part, text_weights(), self.stacked_params,
                                  lambda name: tied and name == "lm_head.weight")
        return used | {"visual." + n for n in load_plain_weights(self.visual, vision, prefix="visual.")}


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder; the tower has RMSNorm, SwiGLU and window attention."""

    windowed_vision: ClassVar[bool] = True
