"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`):
a SigLIP-like vision tower, a pixel-shuffle connector, and a Llama decoder.

What CPU users run at 256M/500M.  The processor (multimodal/idefics3.py) cuts a large
image into tiles plus a downscaled global view, each tile `image_seq_len` placeholder
tokens between row/column marker tokens; the tower encodes each tile (tiles are padded to
a fixed grid, the padding masked out of attention, position ids bucketed to the real
patches: the NaViT trick), the connector folds each 2-D block of scale_factor^2 patches
into one vector (pixel shuffle) and projects it to the decoder's width, and those rows
replace the placeholder tokens' embeddings in order.  The decoder is our Llama, so text
steps run its fused kernels unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.siglip import SiglipEncoder
from pagedserve.models.utils import load_plain_weights, loaded_embedding

# Checkpoint prefixes -> ours (transformers 5 and the hub's SmolVLM/Idefics3 share them).
_TEXT, _VISION, _CONNECTOR = "model.text_model.", "model.vision_model.", "model.connector."


class Idefics3VisionEmbeddings(nn.Module):
    """Patch conv plus learned positions; a tile smaller than the patch grid (padding
    masked out) gets its real patches' positions spread over the whole table by bucketing
    their fractional coordinates, as HF's Idefics3VisionEmbeddings does."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        self.per_side = int(config.image_size) // self.patch_size
        hidden = int(config.hidden_size)
        self.patch_embedding = nn.Conv2d(int(getattr(config, "num_channels", 3)), hidden,
                                         kernel_size=self.patch_size, stride=self.patch_size, padding="valid")
        self.position_embedding = loaded_embedding(self.per_side ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, H, W], patch_mask [B, h, w] bool -> [B, h*w, hidden]."""
        b = pixel_values.shape[0]
        embeds = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=pixel_values.device)
        rows = patch_mask[:, :, 0].sum(dim=1)
        cols = patch_mask[:, 0, :].sum(dim=1)
        h_idx = torch.arange(patch_mask.shape[1], device=pixel_values.device, dtype=torch.float32)
        w_idx = torch.arange(patch_mask.shape[2], device=pixel_values.device, dtype=torch.float32)
        frac_h = (h_idx[None, :] * (1.0 / rows)[:, None]).clamp(max=1.0 - 1e-6)
        frac_w = (w_idx[None, :] * (1.0 / cols)[:, None]).clamp(max=1.0 - 1e-6)
        bucket_h = torch.bucketize(frac_h, boundaries, right=True)
        bucket_w = torch.bucketize(frac_w, boundaries, right=True)
        ids = (bucket_h[:, :, None] * self.per_side + bucket_w[:, None, :]).reshape(b, -1)
        ids = torch.where(patch_mask.reshape(b, -1), ids, torch.zeros_like(ids))
        return embeds + self.position_embedding(ids)


class Idefics3VisionTransformer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        self.embeddings = Idefics3VisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(int(config.hidden_size), eps=float(getattr(config, "layer_norm_eps", 1e-6)))

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """Tiles [B, C, H, W] and their pixel masks [B, H, W] -> patch states [B, N, hidden]."""
        p = self.patch_size
        patch_mask = pixel_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
        hidden = self.embeddings(pixel_values, patch_mask)
        hidden = self.encoder(hidden, patch_mask.reshape(patch_mask.shape[0], -1))
        return self.post_layernorm(hidden)


class Idefics3Connector(nn.Module):
    """Pixel shuffle by `scale_factor` (each s x s block of patches -> one vector of s^2
    times the width), then one bias-free projection to the decoder's width."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.scale = int(config.scale_factor)
        vision = int(config.vision_config.hidden_size)
        self.proj = nn.Linear(vision * self.scale ** 2, int(config.text_config.hidden_size), bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, n, d = hidden.shape
        side, s = int(n ** 0.5), self.scale
        x = hidden.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return self.proj(x.reshape(b, n // (s * s), d * s * s))


class Idefics3ForConditionalGeneration(nn.Module):
    """SupportsImages (multimodal/inputs.py) over a Llama decoder."""

    uses_mrope: ClassVar[bool] = False
    bidirectional_image_attention: ClassVar[bool] = False
    stacked_params = LlamaForCausalLM.stacked_params

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config.text_config
        self.language_model = LlamaForCausalLM(config.text_config)
        self.vision_model = Idefics3VisionTransformer(config.vision_config)
        self.connector = Idefics3Connector(config)

    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's tiles -> its rows (tiles in the processor's order, image_seq_len each)."""
        weight = self.connector.proj.weight
        out = []
        for data in images:
            pixels = data["pixel_values"].to(weight.device, weight.dtype)
            pixels = pixels.reshape(-1, *pixels.shape[-3:])
            mask = data["pixel_attention_mask"].to(weight.device).reshape(-1, *pixels.shape[-2:]).bool()
            real = (pixels != 0).flatten(1).any(dim=1)  # HF drops all-zero padding tiles
            states = self.vision_model(pixels[real], mask[real])
            out.append(self.connector(states).reshape(-1, weight.shape[0]))
        return out

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names: the decoder's through the Llama loader, the tower's and the connector's
        as plain copies (models/utils.load_plain_weights)."""
        text: list[tuple[str, torch.Tensor]] = []
        vision: list[tuple[str, torch.Tensor]] = []
        connector: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name.startswith(_TEXT):
                text.append(("model." + name[len(_TEXT):], tensor))
            elif name == "lm_head.weight":
                text.append((name, tensor))
            elif name.startswith(_VISION):
                vision.append((name[len(_VISION):], tensor))
            elif name.startswith(_CONNECTOR):
                connector.append((name[len(_CONNECTOR):].replace("modality_projection.proj", "proj"), tensor))
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        return (self.language_model.load_weights(text)
                | {_VISION + n for n in load_plain_weights(self.vision_model, vision, prefix=_VISION)}
                | {_CONNECTOR + n for n in load_plain_weights(self.connector, connector, prefix=_CONNECTOR)})
