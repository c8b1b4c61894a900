"""Qwen2-VL / Qwen2.5-VL prompts: each `<|image_pad|>` of the text (the chat template
renders an image part as `<|vision_start|><|image_pad|><|vision_end|>`) becomes one pad
token per decoder row of that image, grid_t * grid_h * grid_w / merge_size**2, as HF's
Qwen2VLProcessor expands it; the image's span is that run of pad tokens, every position
of which takes an encoder row.

Both families also need the M-RoPE positions of the whole prompt (`mrope_positions`):
text advances all three streams together, an image's rows take (start, start + row,
start + column) of its merged grid, and the text after it resumes at start +
max(rows, columns).  Generated tokens continue at their index + `mrope_position_delta`.
HF's image processor is used directly (Qwen2VLImageProcessorPil): AutoProcessor would
also build Qwen2-VL's video processor, which needs torchvision.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedserve.multimodal.inputs import ImageFeature, MultiModalPrompt, content_identifier


def mrope_positions(length: int, images: list[tuple[int, tuple[int, int, int]]],
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """The [3, length] int64 positions (time, height, width) of a prompt whose images sit
    at `images` = [(offset of its first row, (grid_t, grid_h, grid_w) in patches)], in
    prompt order, and the delta later positions add (HF's get_rope_index for images;
    Qwen2.5-VL's time scaling applies to video only, so both families share this)."""
    pieces: list[torch.Tensor] = []
    cursor = 0  # prompt index
    next_pos = 0  # position the next text token takes
    for offset, (t, h, w) in images:
        if offset < cursor:
            raise ValueError(f"image spans overlap or are out of order (an image at {offset}, the previous "
                             f"one ends at {cursor})")
        text = offset - cursor
        pieces.append(torch.arange(text, dtype=torch.long).expand(3, -1) + next_pos)
        next_pos += text
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
        pieces.append(grid.reshape(3, -1) + next_pos)
        next_pos += max(gh, gw)
        cursor = offset + t * gh * gw
    if cursor > length:
        raise ValueError(f"image spans end at {cursor}, past the prompt's {length} tokens")
    pieces.append(torch.arange(length - cursor, dtype=torch.long).expand(3, -1) + next_pos)
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


class Qwen2VLImagePrompts:
    """ImagePromptProcessor of both families (multimodal/registry.py)."""

    placeholder: ClassVar[str] = "<|image_pad|>"

    def __init__(self, model_dir: str, hf_mm_config: Any, tokenizer: Any) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # preprocessor_config.json's min_pixels/max_pixels (or size) bound each image's resize.
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.merge_size = int(self.image_processor.merge_size)
        vision = getattr(hf_mm_config, "vision_config", None)
        model_merge = getattr(vision, "spatial_merge_size", self.merge_size)
        if int(model_merge) != self.merge_size:
            raise ValueError(f"{model_dir}: the image processor merges {self.merge_size}x{self.merge_size} "
                             f"patches but the vision config's spatial_merge_size is {model_merge}")
        self.image_token_id = int(hf_mm_config.image_token_id)
        token_id = tokenizer.convert_tokens_to_ids(self.placeholder) if tokenizer is not None else None
        if token_id is not None and token_id != self.image_token_id:
            raise ValueError(f"{model_dir}: the tokenizer's {self.placeholder} is id {token_id} but the config's "
                             f"image_token_id is {self.image_token_id}")

    def embeds_for_size(self, width: int, height: int) -> int:
        # (HF's own count for a size, which vLLM uses the same way; ValueError past an
        # aspect ratio of 200)
        return int(self.image_processor.get_number_of_image_patches(height, width)) // self.merge_size**2

    def _image(self, image: Any) -> tuple[dict[str, torch.Tensor], tuple[int, int, int], str]:
        """One image's processor outputs, its grid and its content hash."""
        out = self.image_processor(images=[image], return_tensors="pt")
        pixel_values = out["pixel_values"].contiguous()
        grid = out["image_grid_thw"].reshape(1, 3).to(torch.long)
        # blake2b over the processed pixels (the resize and normalisation are in them) and the grid
        identifier = content_identifier("qwen2_vl", pixel_values, grid)
        t, h, w = (int(x) for x in grid[0])
        return {"pixel_values": pixel_values, "image_grid_thw": grid}, (t, h, w), identifier

    def process(self, text: str, images: list[Any], encode: Any) -> MultiModalPrompt:
        count = text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholder(s) ({self.placeholder}) for "
                             f"{len(images)} image(s)")
        processed = [self._image(image) for image in images]
        unit = self.merge_size**2
        sizes = [t * h * w // unit for _, (t, h, w), _ in processed]
        parts = text.split(self.placeholder)
        expanded = parts[0] + "".join(self.placeholder * n + part for n, part in zip(sizes, parts[1:], strict=True))
        ids = list(encode(expanded))
        pads = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(pads) != sum(sizes):
            raise ValueError(f"the tokenized prompt has {len(pads)} {self.placeholder} token(s) where its "
                             f"{len(images)} image(s) need {sum(sizes)}")
        features: list[ImageFeature] = []
        spans: list[tuple[int, tuple[int, int, int]]] = []
        start = 0
        for (data, grid, identifier), n in zip(processed, sizes, strict=True):
            offset = pads[start]
            if pads[start + n - 1] != offset + n - 1:
                raise ValueError(f"the {n} {self.placeholder} tokens of image {len(features) + 1} are not "
                                 "contiguous in the tokenized prompt")
            features.append(ImageFeature(identifier=identifier, offset=offset, length=n, num_embeds=n,
                                         embed_mask=None, data=data))
            spans.append((offset, grid))
            start += n
        positions, delta = mrope_positions(len(ids), spans, self.merge_size)
        return MultiModalPrompt(prompt_token_ids=ids, images=features, mrope_positions=positions,
                                mrope_position_delta=delta)
