"""The plain data of image input, shared by intake, the engine core and the model runner.

An image occupies a *span* of the prompt: `length` positions starting at `offset`,
holding the family's placeholder tokens (and, for some families, row/column or
begin/end marker tokens between them).  The positions whose `embed_mask` is True take
the rows of the image's encoder output, in order; the others keep their token's
embedding.  `identifier` is the image's content hash: it keys the encoder cache and the
prefix cache's blocks (vLLM's extra keys), so the same image reuses both and a different
image of the same size never does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch


def content_identifier(family: str, *tensors: torch.Tensor) -> str:
    """An image's content hash: its pixels as the processor left them (so its resize and
    normalisation settings are in it), with their shapes and dtypes, and the family."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(family.encode())
    for tensor in tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f":{tuple(tensor.shape)}:{tensor.dtype}:".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def token_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `token_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*ids, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


@dataclass
class ImageFeature:
    """One processed image of a prompt."""

    identifier: str  # hex content hash of the decoded pixels and the processor's settings
    offset: int  # first position of the image's span in the prompt
    length: int  # positions in the span
    num_embeds: int  # rows the model's embed_images gives for it (= embed_mask's True count)
    # Per span position: whether it takes an encoder row (None: every position does).
    embed_mask: list[bool] | None
    # The HF image processor's outputs for this image alone (pixel_values, image_grid_thw,
    # pixel_attention_mask, ...), CPU tensors; the family's model reads them.
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalPrompt:
    """A prompt with its image placeholders expanded, as the engine core takes it."""

    prompt_token_ids: list[int]
    images: list[ImageFeature]
    # M-RoPE families (Qwen2-VL): the three position streams (time, height, width) of
    # every prompt position, [3, len(prompt)] int64; generated tokens continue at
    # position + mrope_position_delta in all three.
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0


class ImagePromptProcessor(Protocol):
    """One family's prompt expansion (multimodal/<family>.py), made once per model by
    `registry.make_image_prompt_processor(architecture, model_dir, hf_mm_config, tokenizer)`."""

    # The text a prompt puts where each image goes; chat templates render image parts as it.
    placeholder: ClassVar[str]
    # The token whose positions take an image's encoder rows: only an image's expansion
    # may hold it (a client's text or token ids holding it are refused).
    image_token_id: int

    def embeds_for_size(self, width: int, height: int) -> int:
        """The encoder rows an image of this size takes, from its header's size alone (so
        that an image that can never fit is refused before it is decoded); ValueError for
        a size the family refuses."""
        ...

    def process(self, text: str, images: list[Any], encode: Any) -> MultiModalPrompt:
        """Expand each `placeholder` in `text` for the matching PIL image (in order) as the
        checkpoint's HF processor does, tokenize with `encode(text) -> list[int]` (the
        engine's rule for prompt text), and locate each image's span.  ValueError when
        the placeholder count differs from len(images)."""
        ...


@runtime_checkable
class SupportsImages(Protocol):
    """What the model runner needs of a vision-language model (models/<family>.py)."""

    # Positions are [3, T] (M-RoPE) rather than [T].
    uses_mrope: ClassVar[bool]
    # Tokens of one image attend to each other both ways in the prompt (Gemma 3): the
    # runner then never splits an image's span across prefill chunks and lists the spans
    # in the forward context (forward_context.BidirectionalSpan).
    bidirectional_image_attention: ClassVar[bool]

    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's processor outputs (ImageFeature.data) -> its [num_embeds, hidden]
        rows in the model's dtype, projected into the decoder's embedding space."""
        ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] exactly as the decoder's forward makes them from ids
        (any family scaling applied), so that image rows can replace some."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As a text model's forward; `inputs_embeds` (from embed_input_ids with image rows
        put in) replaces the embedding of `input_ids` when given."""
        ...
