"""Gemma 3's prompt expansion for images, as HF's Gemma3Processor does it.

Gemma 3's chat template renders an image part as `<start_of_image>`; the processor
replaces each with `\\n\\n<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
`<end_of_image>\\n\\n`.  Only the soft-token run takes the image's rows, and only it is
marked as image in HF's token_type_ids (the tokens that attend to each other both ways),
so an image's span here is exactly that run: embed_mask None, bidirectional span = span.
Images are resized to the tower's fixed size by the checkpoint's own PIL image processor
(Gemma3ImageProcessorPil; torchvision is not needed); pan-and-scan, which adds crops and
text around them, is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedserve.multimodal.inputs import ImageFeature, MultiModalPrompt, content_identifier, token_runs


class Gemma3ImagePrompts:
    """The ImagePromptProcessor of Gemma3ForConditionalGeneration checkpoints."""

    placeholder: ClassVar[str] = "<start_of_image>"

    def __init__(self, model_dir: str, hf_mm_config: Any, tokenizer: Any) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        self.mm_tokens_per_image = int(hf_mm_config.mm_tokens_per_image)
        window = getattr(hf_mm_config.text_config, "sliding_window", None)
        if window and self.mm_tokens_per_image >= int(window):
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image} must be below the text model's "
                             f"sliding_window={window}: an image's tokens attend to each other both ways and "
                             "are read back from the sliding layers' cache blocks")
        self.image_processor = Gemma3ImageProcessorPil.from_pretrained(model_dir)
        if getattr(self.image_processor, "do_pan_and_scan", None):
            raise ValueError(f"{model_dir}: the image processor enables do_pan_and_scan, which is not "
                             "supported (set it to false in preprocessor_config.json)")
        self.image_token_id = int(hf_mm_config.image_token_id)
        boi_id = int(hf_mm_config.boi_token_id)
        eoi_id = getattr(hf_mm_config, "eoi_token_id", None)
        image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        boi = tokenizer.convert_ids_to_tokens(boi_id)
        if boi != self.placeholder or not image_token:
            raise ValueError(f"the tokenizer's boi token (id {boi_id}) is {boi!r} and image token "
                             f"(id {self.image_token_id}) is {image_token!r}; Gemma 3 expects "
                             f"{self.placeholder!r} and '<image_soft_token>'")
        eoi = tokenizer.convert_ids_to_tokens(int(eoi_id)) if eoi_id is not None else "<end_of_image>"
        self.expansion = f"\n\n{boi}{image_token * self.mm_tokens_per_image}{eoi}\n\n"

    def embeds_for_size(self, width: int, height: int) -> int:
        return self.mm_tokens_per_image  # (every image is resized to the tower's fixed size)

    def process(self, text: str, images: list[Any], encode: Any) -> MultiModalPrompt:
        count = text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholder(s) {self.placeholder!r} but "
                             f"{len(images)} image(s) were given")
        ids = list(encode(self.expansion.join(text.split(self.placeholder))))
        spans = token_runs(ids, self.image_token_id)
        if len(spans) != len(images) or any(length != self.mm_tokens_per_image for _, length in spans):
            raise ValueError(f"the prompt's text holds the image token (id {self.image_token_id}) itself: "
                             f"expected {len(images)} run(s) of {self.mm_tokens_per_image}, found lengths "
                             f"{[length for _, length in spans]}")
        features = []
        if images:
            pixels = self.image_processor.preprocess(list(images), return_tensors="pt")["pixel_values"]
            for (offset, length), one in zip(spans, pixels.split(1), strict=True):
                features.append(ImageFeature(
                    identifier=content_identifier("gemma3", one), offset=offset, length=length,
                    num_embeds=self.mm_tokens_per_image, embed_mask=None, data={"pixel_values": one}))
        return MultiModalPrompt(prompt_token_ids=ids, images=features)

