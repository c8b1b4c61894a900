"""Gemma 3 with image input: `Gemma3ForConditionalGeneration` (the 4B/12B/27B models).

A SigLIP tower (models/siglip.py) encodes each image, pre-resized to the tower's
`image_size`, to one state per patch; the multi-modal projector average-pools the patch
grid down to `mm_tokens_per_image` states (a square), norms them with Gemma's RMSNorm
and projects them into the decoder's embedding space with one matrix.  Those rows
replace the embeddings of the prompt's `<image_soft_token>` run (multimodal/gemma3.py
expands each image placeholder to it), unscaled, while text tokens keep Gemma's
sqrt(hidden_size)-scaled embedding: HF embeds every id, then masked-scatters the image
features over the image positions.  The decoder is the text model (models/gemma3.py);
the one difference is that an image's tokens attend to each other both ways
(`bidirectional_image_attention`: the runner lists the spans in the forward context and
layers/attention.py applies them).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.layernorm import GemmaRMSNorm
from pagedserve.models.gemma3 import Gemma3ForCausalLM
from pagedserve.models.siglip import SiglipVisionModel
from pagedserve.models.utils import load_plain_weights

# Checkpoint prefixes -> our module prefixes: transformers 5 in memory (`model.*`), the
# hub's older layout (`language_model.model.*`, `vision_tower.vision_model.*`), and what
# transformers 5.24's save_pretrained writes (the older text names, `vision_tower.*`).
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def our_name(name: str) -> str | None:
    """A checkpoint tensor's name in this module tree, or None when no prefix matches."""
    for theirs, ours in _PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return None


class Gemma3MultiModalProjector(nn.Module):
    """Patch states [B, patches, vision_hidden] -> image rows [B, mm_tokens, text_hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        tokens = int(config.mm_tokens_per_image)
        self.tokens_per_side = int(round(tokens ** 0.5))
        if self.tokens_per_side ** 2 != tokens or self.patches_per_side % self.tokens_per_side:
            raise ValueError(f"mm_tokens_per_image={tokens} must be the square of a divisor of the "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid (an average pool "
                             "reduces the grid to it)")
        self.kernel = self.patches_per_side // self.tokens_per_side
        self.eps = float(getattr(vision, "layer_norm_eps", 1e-6))
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(int(vision.hidden_size), int(text.hidden_size)))
        self.mm_soft_emb_norm = GemmaRMSNorm(int(vision.hidden_size), self.eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        b, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(b, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, hidden)).reshape(pooled.shape)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)


class Gemma3ForConditionalGeneration(nn.Module):
    """The whole VLM, built from the checkpoint's composite `Gemma3Config`."""

    uses_mrope: ClassVar[bool] = False
    bidirectional_image_attention: ClassVar[bool] = True
    stacked_params = Gemma3ForCausalLM.stacked_params

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        text_config = config.text_config
        self.mm_tokens_per_image = int(config.mm_tokens_per_image)
        window = getattr(text_config, "sliding_window", None)
        if window and self.mm_tokens_per_image >= int(window):
            # layers/attention.py reads an image's keys back from the sliding layers' blocks,
            # which hold only the last `sliding_window` positions.
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image} must be below the text model's "
                             f"sliding_window={window}: an image's tokens attend to each other both ways")
        if getattr(text_config, "use_bidirectional_attention", False):
            raise ValueError("text_config.use_bidirectional_attention=True (an encoder-only Gemma 3) is not "
                             "implemented for Gemma3ForConditionalGeneration")
        if getattr(text_config, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"text_config.attn_logit_softcapping={text_config.attn_logit_softcapping!r} "
                             "is not implemented: no attention backend soft-caps scores")
        # HF ties the LM head by the composite config's flag (its _tied_weights_keys);
        # the text model reads its own config's, so align the two.
        tied = bool(getattr(config, "tie_word_embeddings", getattr(text_config, "tie_word_embeddings", True)))
        if bool(getattr(text_config, "tie_word_embeddings", True)) != tied:
            text_config = copy.copy(text_config)
            text_config.tie_word_embeddings = tied
        self.text_config = text_config
        self.image_token_id = int(config.image_token_id)
        self.vocab_size = int(text_config.vocab_size)
        self.language_model = Gemma3ForCausalLM(text_config)
        self.vision_tower = SiglipVisionModel(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    @property
    def tie_word_embeddings(self) -> bool:
        return self.language_model.tie_word_embeddings

    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's `pixel_values` [1, 3, H, W] -> its [mm_tokens_per_image, hidden]
        rows in the decoder's dtype; all images go through the tower as one batch."""
        if not images:
            return []
        pixels = torch.cat([image["pixel_values"].reshape(-1, *image["pixel_values"].shape[-3:])
                            for image in images])
        if pixels.shape[0] != len(images):
            raise ValueError(f"Gemma 3 takes one pixel_values crop per image, got {pixels.shape[0]} for "
                             f"{len(images)} image(s) (pan-and-scan crops are not supported)")
        rows = self.multi_modal_projector(self.vision_tower(pixels))
        dtype = self.language_model.model.embed_tokens.weight.dtype
        return list(rows.to(dtype).unbind(0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's scaled token embeddings; the image token's id, when outside the
        vocabulary, embeds as id 0 (HF does the same, and those rows are replaced anyway)."""
        if self.image_token_id >= self.vocab_size:
            input_ids = torch.where(input_ids == self.image_token_id, torch.zeros_like(input_ids), input_ids)
        return self.language_model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None and self.image_token_id >= self.vocab_size:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Either naming convention (see _PREFIXES) -> parameters.  Text tensors stream to
        the decoder's loader (fused q|k|v and gate|up); the tower's and projector's, a few
        percent of the checkpoint, are held until it is done.  Returns the checkpoint
        names used; ValueError names any missing, stray or mis-shaped tensor."""
        vision: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []
        stray: list[str] = []
        original: dict[str, str] = {}

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                mapped = our_name(name)
                if mapped is None:
                    stray.append(name)
                    continue
                original[mapped] = name
                if mapped.startswith("language_model."):
                    yield mapped[len("language_model."):], tensor
                elif mapped.startswith("vision_tower."):
                    vision.append((mapped[len("vision_tower."):], tensor))
                else:
                    projector.append((mapped[len("multi_modal_projector."):], tensor))

        used = {f"language_model.{name}" for name in self.language_model.load_weights(text_weights())}
        if stray:
            raise ValueError(f"checkpoint has {len(stray)} tensor(s) this model does not use "
                             f"(not a Gemma3ForConditionalGeneration checkpoint?): {', '.join(sorted(stray)[:8])}")
        used |= {f"vision_tower.{name}" for name in self.vision_tower.load_weights(vision)}
        used |= {f"multi_modal_projector.{name}" for name in load_plain_weights(self.multi_modal_projector, projector)}
        return {original[name] for name in used}
