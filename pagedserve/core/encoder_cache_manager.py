"""EncoderCacheManager: which images' encoder outputs the model runner holds.

vLLM v1's name and role.  A vision encoder's output for an image is needed by every
prefill chunk that covers part of the image's span, and again after a preemption; running
the encoder once per image and keeping its rows is what lets chunked prefill cut through
an image, and lets a request that sends an image already seen skip the encoder.  Outputs
are keyed by the image's content hash and counted in embedding rows against a capacity.
An entry is referenced by the requests still computing its span; unreferenced entries
stay cached (a repeated image finds them) until their room is needed, least recently
used first.  The runner computes an output the first time a step needs it and drops the
ones this manager names in `SchedulerOutput.free_encoder_ids`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from pagedserve.core.kv_cache_utils import ImageSpan


class RequestWithImages(Protocol):
    request_id: str
    images: Sequence[ImageSpan]


class EncoderCacheManager:
    def __init__(self, capacity: int, whole_images: bool = False) -> None:
        """`capacity`: embedding rows the runner may hold at once, and may compute in one
        step.  `whole_images` (disable_chunked_mm_input): a chunk that reaches into an
        image takes it to its end."""
        self.capacity = capacity
        self.whole_images = whole_images
        self.compute_left = capacity  # rows the encoder may still compute this step
        self.rows: OrderedDict[str, int] = OrderedDict()  # identifier -> rows, least recently used first
        self.refs: dict[str, set[str]] = {}  # identifier -> requests still computing its span
        self.used = 0
        self.freed: list[str] = []  # evicted since the last step: the runner drops them
        self.hits = 0  # images found cached (a request's first use of each)
        self.misses = 0

    def begin_step(self) -> None:
        self.compute_left = self.capacity

    def fit(self, request: RequestWithImages, start: int, n: int) -> int:
        """The tokens of [start, start + n) that can run this step given the request's
        images: each image the chunk reaches needs its encoder output held (computed this
        step if new, within the step's rows), and with `whole_images` a chunk that reaches
        into an image must take it to its end.  The chunk is cut before the first image
        that cannot run now (0: nothing runs this step).  Images the request has computed
        are released."""
        end, req_id = start + n, request.request_id
        for image in request.images:
            image_end = image.offset + image.length
            if image_end <= start:
                self.release(req_id, image)  # computed: its rows are no longer needed
                continue
            if image.offset >= end:
                break
            cut = max(start, image.offset)
            if self.whole_images and end < image_end:
                return cut - start
            if not self.holds(req_id, image):
                rows = self.allocate(req_id, image, image.num_embeds, self.compute_left)
                if rows is None:
                    return cut - start
                self.compute_left -= rows
        return n

    def release_request(self, request: RequestWithImages) -> None:
        """The request finished or was preempted: its references go."""
        for image in request.images:
            self.release(request.request_id, image)

    def holds(self, request_id: str, image: ImageSpan) -> bool:
        """The request already references this image's output."""
        return request_id in self.refs.get(image.identifier, ())

    def allocate(self, request_id: str, image: ImageSpan, num_embeds: int, compute_left: int) -> int | None:
        """Reference the image's output for the request: the rows the encoder must compute
        for it this step (0: cached), or None when it cannot be held now (no room among
        unreferenced entries, or more than `compute_left` rows to compute)."""
        key = image.identifier
        if key in self.rows:
            self.rows.move_to_end(key)
            self.refs.setdefault(key, set()).add(request_id)
            self.hits += 1
            return 0
        if num_embeds > compute_left or not self._make_room(num_embeds):
            return None
        self.rows[key] = num_embeds
        self.used += num_embeds
        self.refs[key] = {request_id}
        self.misses += 1
        return num_embeds

    def _make_room(self, num_rows: int) -> bool:
        if self.used + num_rows <= self.capacity:
            return True
        free = sum(n for k, n in self.rows.items() if not self.refs.get(k))
        if self.used - free + num_rows > self.capacity:
            return False
        for key in [k for k in self.rows if not self.refs.get(k)]:
            self.used -= self.rows.pop(key)
            self.refs.pop(key, None)
            self.freed.append(key)
            if self.used + num_rows <= self.capacity:
                break
        return True

    def release(self, request_id: str, image: ImageSpan) -> None:
        """The request has computed the image's span (or no longer runs): its reference
        goes; the output stays cached until its room is needed."""
        holders = self.refs.get(image.identifier)
        if holders is not None:
            holders.discard(request_id)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def reset(self) -> None:
        """Drop every unreferenced output (a prefix-cache reset drops these too)."""
        for key in [k for k in self.rows if not self.refs.get(k)]:
            self.used -= self.rows.pop(key)
            self.refs.pop(key, None)
            self.freed.append(key)
