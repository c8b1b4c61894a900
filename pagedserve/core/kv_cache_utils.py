"""Content hashes of full KV blocks: the keys of the prefix cache.

A block's hash covers its parent's hash, so equal hashes mean equal *prefixes*, not
just equal blocks, and a lookup can stop at the first miss.  xxh3-128 keeps
collisions out of reach (64 bits would be birthday-close at scale) and, unlike
Python's `hash()`, is the same in every process, so tensor-parallel workers or a
restarted server agree on keys.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import xxhash

BlockHash = int

# Parent of the first block: a fixed 128-bit value, so every hashed input has the
# same layout and "no parent" cannot collide with a crafted token prefix.
NONE_HASH: BlockHash = xxhash.xxh3_128_intdigest(b"pagedserve/none-hash")

_xxh3_128 = xxhash.xxh3_128_intdigest
_MASK_128 = (1 << 128) - 1


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block).

    Layout: parent (16 bytes) | token count (8) | tokens (8 each) | repr(extra_keys).
    The count makes the token/extra boundary unambiguous.
    """
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    data = (parent_block_hash & _MASK_128).to_bytes(16, "little")
    data += len(block_token_ids).to_bytes(8, "little")
    data += array("q", block_token_ids).tobytes()
    if extra_keys:
        data += repr(tuple(extra_keys)).encode()
    return _xxh3_128(data)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_full_blocks: int | None = None,
    cache_salt: object = None,
    image_spans: Sequence[ImageSpan] = (),
) -> list[BlockHash]:
    """Append hashes for the full blocks of `token_ids` not yet in `block_hashes`.

    Hashes already present are reused, so a request's blocks are hashed exactly
    once over its lifetime.  Stops at `num_full_blocks` when given.  The salt (a
    client's string, or a tuple with the request's LoRA adapter: core/request.py) goes
    into the first block only; the chain carries it to every later block.  A block that
    holds positions of an image adds that image's identifier (vLLM's extra keys): the
    placeholder tokens of two images of one size are equal, their KV is not.
    """
    total = len(token_ids) // block_size
    if num_full_blocks is not None and num_full_blocks < total:
        total = num_full_blocks
    i = len(block_hashes)
    if i >= total:
        return block_hashes
    # Same bytes as hash_block_tokens, but the tokens of all new blocks are packed once.
    parent = block_hashes[-1] if block_hashes else NONE_HASH
    stride = 8 * block_size
    packed = array("q", token_ids[i * block_size : total * block_size]).tobytes()
    count = block_size.to_bytes(8, "little")
    offset = 0
    append = block_hashes.append
    for j in range(i, total):
        data = (parent & _MASK_128).to_bytes(16, "little") + count + packed[offset : offset + stride]
        if j == 0 and cache_salt is not None:
            data += repr((cache_salt,)).encode()
        if image_spans:
            data += images_in(image_spans, j * block_size, (j + 1) * block_size)
        parent = _xxh3_128(data)
        append(parent)
        offset += stride
    return block_hashes


class ImageSpan(Protocol):
    """An image's positions in a prompt (multimodal/inputs.py's ImageFeature)."""

    identifier: str
    offset: int
    length: int
    num_embeds: int  # the encoder's rows for it


def images_in(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The identifiers of the images with positions in [start, end), as hash input."""
    ids = [s.identifier for s in spans if s.offset < end and s.offset + s.length > start]
    return repr(("images", *ids)).encode() if ids else b""


class HashedRequest(Protocol):
    """What hashing needs of a request (core/request.py): its tokens, the chain hashed so
    far (extended in place, so each block is hashed once over the request's life) and
    the salt of its first block."""

    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    images: Sequence[ImageSpan]

    @property
    def hash_salt(self) -> object: ...


def hash_request_blocks(request: HashedRequest, block_size: int, num_full_blocks: int | None = None) -> list[BlockHash]:
    """The request's chain of full-block hashes, extended to its full blocks (or the first
    `num_full_blocks`); the KV-cache manager and its collaborators all key blocks by it."""
    return extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, num_full_blocks,
                               request.hash_salt, request.images)


def hash_request_tokens(
    token_ids: Sequence[int], block_size: int, cache_salt: object = None
) -> list[BlockHash]:
    """The full hash chain of a token sequence (the partial tail block is not hashed)."""
    return extend_block_hashes([], token_ids, block_size, cache_salt=cache_salt)

