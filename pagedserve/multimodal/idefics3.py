"""Idefics3's and SmolVLM's prompt expansion for images, as their HF processors do it.

The chat templates render an image part as `<image>`.  The checkpoint's PIL image
processor resizes the image and, when it is larger than one tile, cuts it into rows x
cols tiles plus a downscaled global view; the processor then writes, per tile,
`<fake_token_around_image><row_R_col_C>` + `<image>` x image_seq_len (a newline after
each row of tiles), and for the global view `<fake_token_around_image><global-img>` +
`<image>` x image_seq_len + `<fake_token_around_image>` (a single-tile image has only
that part).  An image's span runs from its first to its last `<image>` token; only the
`<image>` positions take its rows (embed_mask), tile after tile, the global view last.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedserve.multimodal.inputs import ImageFeature, MultiModalPrompt, content_identifier

FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


class Idefics3ImagePrompts:
    """The ImagePromptProcessor of Idefics3/SmolVLM checkpoints."""

    placeholder: ClassVar[str] = "<image>"

    def __init__(self, model_dir: str, hf_mm_config: Any, tokenizer: Any) -> None:
        if hf_mm_config.model_type == "smolvlm":
            from transformers.models.smolvlm.image_processing_pil_smolvlm import (
                SmolVLMImageProcessorPil as Images,
            )
        else:
            from transformers.models.idefics3.image_processing_pil_idefics3 import (
                Idefics3ImageProcessorPil as Images,
            )
        self.image_processor = Images.from_pretrained(model_dir)
        vision = hf_mm_config.vision_config
        # What the connector leaves of one tile's patches (HF's image_seq_len).
        self.image_seq_len = (int(vision.image_size) // int(vision.patch_size)) ** 2 // int(hf_mm_config.scale_factor) ** 2
        self.image_token_id = int(hf_mm_config.image_token_id)
        token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        if token != self.placeholder:
            raise ValueError(f"the tokenizer's image token (id {self.image_token_id}) is {token!r}, not "
                             f"{self.placeholder!r}")
        self.family = hf_mm_config.model_type

    def embeds_for_size(self, width: int, height: int) -> int:
        # (HF's own count of tiles for a size: rows x cols + the global view, or the global
        # view alone)
        tiles = int(self.image_processor.get_number_of_image_patches(height, width)[0])
        return max(tiles, 1) * self.image_seq_len

    def expansion(self, rows: int, cols: int) -> str:
        tile = self.placeholder * self.image_seq_len
        text = ""
        if rows or cols:
            for r in range(rows):
                text += "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
            text += "\n"
        return text + f"{FAKE}{GLOBAL}{tile}{FAKE}"

    def process(self, text: str, images: list[Any], encode: Any) -> MultiModalPrompt:
        count = text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholder(s) {self.placeholder!r} but "
                             f"{len(images)} image(s) were given")
        processed = []
        for image in images:
            out = self.image_processor([[image]], return_tensors="pt", return_row_col_info=True)
            processed.append((out["pixel_values"][0], out["pixel_attention_mask"][0],
                              int(out["rows"][0][0]), int(out["cols"][0][0])))
        pieces = text.split(self.placeholder)
        expanded = pieces[0] + "".join(self.expansion(rows, cols) + piece
                                       for (_, _, rows, cols), piece in zip(processed, pieces[1:], strict=True))
        ids = list(encode(expanded))
        per_image = [pixels.shape[0] * self.image_seq_len for pixels, _, _, _ in processed]
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != sum(per_image):
            raise ValueError(f"the prompt's text holds the image token {self.placeholder!r} (id "
                             f"{self.image_token_id}) outside its images' expansion")
        features, start = [], 0
        for (pixels, mask, _, _), n in zip(processed, per_image, strict=True):
            first, last = positions[start], positions[start + n - 1]
            embed_mask = [t == self.image_token_id for t in ids[first:last + 1]]
            features.append(ImageFeature(
                identifier=content_identifier(self.family, pixels, mask), offset=first, length=last + 1 - first,
                num_embeds=n, embed_mask=embed_mask, data={"pixel_values": pixels, "pixel_attention_mask": mask}))
            start += n
        return MultiModalPrompt(ids, features)
