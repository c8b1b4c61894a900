"""The model runner's image state: each running request's images, the encoder cache, and
per step the decoder's inputs that images change.

A vision-language model's step differs from a text step in three ways, all prepared
here from what the scheduler sent: (1) the token embeddings of positions inside an
image's span are replaced by rows of the image's encoder output (computed once per image
and kept by content hash until the scheduler's EncoderCacheManager frees it: chunked
prefill and preemption never run the encoder twice), (2) M-RoPE models (Qwen2-VL) take
[3, T] positions, read from each request's precomputed table in the prompt and shifted by
its delta after it, and (3) for families whose image tokens attend both ways (Gemma 3)
each image in the step is listed for the attention layers (forward_context.BidirectionalSpan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.forward_context import BidirectionalSpan
from pagedserve.multimodal.inputs import ImageFeature, SupportsImages


@dataclass
class RequestImages:
    images: Sequence[ImageFeature]
    mrope: tuple[torch.Tensor, int] | None = None  # (positions [3, prompt], delta)


@dataclass
class ImageStepInputs:
    """What a step passes to the model besides ids and positions."""

    inputs_embeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [3, T] for M-RoPE models
    spans: list[BidirectionalSpan] = field(default_factory=list)


class ImageInputs:
    def __init__(self, model: SupportsImages, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.uses_mrope = bool(model.uses_mrope)
        self.bidirectional = bool(model.bidirectional_image_attention)
        self.requests: dict[str, RequestImages] = {}
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoder_runs = 0  # images encoded (a test's and the benchmark's view of the cache)

    def update(self, sched_out: SchedulerOutput) -> None:
        """Drop what the scheduler freed and what left; take the new requests' images."""
        for key in sched_out.free_encoder_ids:
            self.encoder_cache.pop(key, None)
        for req_id in (*sched_out.finished_req_ids, *sched_out.preempted_req_ids):
            self.requests.pop(req_id, None)
        for new in sched_out.scheduled_new_reqs:
            if new.images or new.mrope is not None:
                self.requests[new.req_id] = RequestImages(tuple(new.images), new.mrope)

    def prepare(self, req_ids: list[str], seq_lens: np.ndarray, query_start: np.ndarray,
                input_ids: torch.Tensor, positions: torch.Tensor) -> ImageStepInputs:
        """This step's image inputs for requests `req_ids` (request i's tokens are rows
        [query_start[i], query_start[i + 1]) of the flat batch, ending at seq_lens[i])."""
        out = ImageStepInputs()
        num_new = np.diff(query_start)
        computed = seq_lens - num_new
        if self.uses_mrope:
            out.positions = self._mrope_positions(req_ids, computed, num_new, query_start, positions)
        pieces: list[tuple[int, torch.Tensor]] = []  # (first flat row, consecutive embedding rows)
        scattered: list[tuple[torch.Tensor, torch.Tensor]] = []  # (flat rows, embedding rows)
        for i, req_id in enumerate(req_ids):
            state = self.requests.get(req_id)
            if state is None or not state.images:
                continue
            start, end = int(computed[i]), int(computed[i] + num_new[i])
            for image in state.images:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo >= hi:
                    continue
                rows = self._encoder_output(image)
                first = int(query_start[i]) + lo - start
                if image.embed_mask is None:
                    pieces.append((first, rows[lo - image.offset:hi - image.offset]))
                else:  # only the span's placeholder positions take rows, in order
                    where = [j for j, takes in enumerate(image.embed_mask[lo - image.offset:hi - image.offset])
                             if takes]
                    before = sum(image.embed_mask[:lo - image.offset])
                    scattered.append((torch.tensor(where, dtype=torch.long) + first,
                                      rows[before:before + len(where)]))
                if self.bidirectional:
                    out.spans.append(BidirectionalSpan(i, first, first + hi - lo, image.offset, image.end))
        if pieces or scattered:
            embeds = self.model.embed_input_ids(input_ids)
            for row, values in pieces:
                embeds[row:row + len(values)] = values.to(embeds.dtype)
            for index, values in scattered:
                embeds.index_copy_(0, index.to(embeds.device), values.to(embeds.dtype))
            out.inputs_embeds = embeds
        return out

    def _encoder_output(self, image: ImageFeature) -> torch.Tensor:
        rows = self.encoder_cache.get(image.identifier)
        if rows is None:
            data = {k: v.to(self.device) for k, v in image.data.items()}
            rows = self.model.embed_images([data])[0]
            if rows.shape[0] != image.num_embeds:
                raise ValueError(f"the vision encoder gave {rows.shape[0]} rows for an image whose prompt "
                                 f"holds {image.num_embeds} places")
            self.encoder_cache[image.identifier] = rows
            self.encoder_runs += 1
        return rows

    def _mrope_positions(self, req_ids: list[str], computed: np.ndarray, num_new: np.ndarray,
                         query_start: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        """[3, T]: every stream equal to the plain position, except for requests with an
        M-RoPE table: its values inside the prompt, position + delta after it."""
        out = positions.unsqueeze(0).repeat(3, 1)
        for i, req_id in enumerate(req_ids):
            state = self.requests.get(req_id)
            if state is None or state.mrope is None:
                continue
            table, delta = state.mrope
            start, end, q0 = int(computed[i]), int(computed[i] + num_new[i]), int(query_start[i])
            split = min(end, table.shape[1])  # (a beam's step: its prompt runs on past the table)
            if start < split:
                out[:, q0:q0 + split - start] = table[:, start:split].to(out.device)
            if delta and end > max(start, split):
                lo = max(start, split)
                out[:, q0 + lo - start:q0 + end - start] += delta
        return out


def image_inputs_for(model: Any, device: torch.device) -> ImageInputs | None:
    """The runner's image state for a vision-language model, else None."""
    return ImageInputs(model, device) if isinstance(model, SupportsImages) else None
