"""EncoderCacheManager: referenced outputs are never evicted, room is never exceeded, and
chunks are cut before images that cannot run now."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.encoder_cache_manager import EncoderCacheManager


@dataclass
class Image:
    identifier: str
    offset: int
    length: int
    num_embeds: int


@dataclass
class Req:
    request_id: str
    images: list[Image]


def test_a_repeated_image_is_a_hit_and_room_is_reused_least_recently_used_first() -> None:
    cache = EncoderCacheManager(capacity=10)
    a, b, c = Image("a", 0, 4, 4), Image("b", 0, 4, 4), Image("c", 0, 4, 4)
    assert cache.allocate("r1", a, 4, 10) == 4 and cache.allocate("r2", a, 4, 10) == 0  # a hit
    assert cache.allocate("r3", b, 4, 10) == 4
    assert cache.allocate("r4", c, 4, 10) is None  # both referenced: no room
    cache.release("r1", a), cache.release("r2", a)
    assert cache.allocate("r4", c, 4, 10) == 4 and cache.take_freed() == ["a"]
    assert cache.allocate("r5", a, 4, 10) is None  # b and c referenced
    cache.release("r3", b)
    assert cache.allocate("r5", a, 4, 3) is None  # over this step's compute rows
    assert cache.allocate("r5", a, 4, 10) == 4 and cache.take_freed() == ["b"]


def test_fit_cuts_chunks_before_images_that_cannot_run() -> None:
    req = Req("r", [Image("x", 4, 8, 8), Image("y", 20, 8, 8)])
    cache = EncoderCacheManager(capacity=8)
    assert cache.fit(req, 0, 30) == 20  # y has no room while x is referenced
    assert cache.fit(req, 20, 10) == 0  # and this step's encoder rows are spent
    cache.begin_step()
    assert cache.fit(req, 20, 10) == 10  # x computed: released, evicted for y
    assert cache.take_freed() == ["x"]
    whole = EncoderCacheManager(capacity=64, whole_images=True)
    assert whole.fit(Req("s", [Image("x", 4, 8, 8)]), 0, 6) == 4  # never into an image it cannot finish
    assert whole.fit(Req("s", [Image("x", 4, 8, 8)]), 4, 6) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7), st.integers(1, 6), st.booleans()), max_size=40))
def test_room_and_references_hold_under_any_sequence(ops) -> None:
    cache = EncoderCacheManager(capacity=12)
    for req, key, rows, release in ops:
        image = Image(f"i{key}", 0, rows, rows)
        if release:
            cache.release(f"r{req}", image)
        else:
            cache.allocate(f"r{req}", image, cache.rows.get(image.identifier, rows), 12)
        assert cache.used == sum(cache.rows.values()) <= cache.capacity
        assert all(k in cache.rows for k, holders in cache.refs.items() if holders)
