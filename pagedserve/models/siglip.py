"""SigLIP's vision encoder (the image tower of Gemma 3, and the encoder stack Idefics3 /
SmolVLM reuse), as HF's `SiglipVisionModel` computes it.

Plain torch modules (nn.Linear, nn.LayerNorm), not the decoder's parallel layers: the
tower runs once per new image (its output is cached by content hash), it is a few
percent of a VLM's weights, and its attention is full and bidirectional over one image's
patches, so it needs none of the paged-cache machinery.  Parameter names are HF's
(`embeddings.*`, `encoder.layers.N.*`, `post_layernorm.*`), so a checkpoint's tensors
load by name once its family strips the tower prefix.

The encoder stack (`SiglipEncoder`) takes an optional attention mask because Idefics3's
tower pads images to a fixed patch grid and masks the padding patches out of the keys;
its embeddings (bucketed position ids) differ, so it brings its own and reuses the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.utils import load_plain_weights, loaded_embedding


def siglip_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The encoder MLP's activation by its HF `hidden_act` name; anything else is refused
    by name rather than silently swapped for a different curve."""
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported SigLIP hidden_act {name!r}: only gelu_pytorch_tanh, gelu and quick_gelu")


class SiglipVisionEmbeddings(nn.Module):
    """Non-overlapping patches (a stride-`patch_size` conv) plus one learned position
    embedding per patch of the fixed `image_size` grid (images come pre-resized to it)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        self.image_size = int(config.image_size)
        hidden = int(config.hidden_size)
        self.patch_embedding = nn.Conv2d(int(getattr(config, "num_channels", 3)), hidden,
                                         kernel_size=self.patch_size, stride=self.patch_size, padding="valid")
        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.position_embedding = loaded_embedding(self.num_patches, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> [B, num_patches, hidden] (row-major patch order)."""
        _, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            # HF would interpolate the position table only when asked to; Gemma 3's
            # processor always resizes to image_size, so a different size is a caller bug.
            raise ValueError(f"SigLIP expects {self.image_size}x{self.image_size} pixels, got {height}x{width}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(device=weight.device, dtype=weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    """Multi-head attention over all patches both ways (no causal mask, no RoPE)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = hidden // self.num_heads
        if self.head_dim * self.num_heads != hidden:
            raise ValueError(f"SigLIP hidden_size {hidden} is not divisible by num_attention_heads {self.num_heads}")
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, N, hidden]; attention_mask: None, or as scaled_dot_product_attention
        takes it (bool: True = may attend; float: added to the scores), broadcast to
        [B, heads, N, N]."""
        b, n, _ = hidden.shape
        q = self.q_proj(hidden).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scale)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class SiglipMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.act = siglip_activation(getattr(config, "hidden_act", "gelu_pytorch_tanh"))
        self.fc1 = nn.Linear(int(config.hidden_size), int(config.intermediate_size))
        self.fc2 = nn.Linear(int(config.intermediate_size), int(config.hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = float(getattr(config, "layer_norm_eps", 1e-6))
        self.layer_norm1 = nn.LayerNorm(int(config.hidden_size), eps=eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(int(config.hidden_size), eps=eps)
        self.mlp = SiglipMLP(config)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden), attention_mask)
        return hidden + self.mlp(self.layer_norm2(hidden))


def patch_attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """A [B, N] bool mask of real (not padding) patches -> the [B, 1, 1, N] key mask
    scaled_dot_product_attention broadcasts over heads and queries (HF's bidirectional
    mask from a padding mask: every query sees exactly the real patches)."""
    return valid.to(torch.bool)[:, None, None, :]


class SiglipEncoder(nn.Module):
    """The stack of encoder layers, shared by every family with a SigLIP-like tower."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(int(config.num_hidden_layers)))

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attention_mask: None (every patch sees every patch), a [B, N] bool mask of real
        patches (patch_attention_mask), or a full mask as SiglipAttention takes it."""
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = patch_attention_mask(attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask)
        return hidden


class SiglipVisionModel(nn.Module):
    """Embeddings, encoder, post layernorm: HF's `SiglipVisionModel` last_hidden_state.
    The attention-pooling head (`vision_use_head`) is not built: the VLMs here read the
    per-patch states, never the pooled vector (their checkpoints' head tensors, if any,
    are skipped by `load_weights`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(int(config.hidden_size), eps=float(getattr(config, "layer_norm_eps", 1e-6)))

    def forward(self, pixel_values: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> [B, num_patches, hidden]."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values), attention_mask))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tower-relative HF names (`embeddings.*`, `encoder.*`, `post_layernorm.*`) ->
        parameters; ValueError names a missing, stray or mis-shaped tensor."""
        return load_plain_weights(self, weights, skip=lambda name: name.startswith("head."))
