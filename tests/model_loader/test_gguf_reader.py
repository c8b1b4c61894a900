"""The GGUF reader's checks of a file's layout (model_loader/gguf_utils.open_gguf): what
llama.cpp refuses is refused, naming the file, before any weight is read."""

from __future__ import annotations

import struct

import pytest

from pagedserve.model_loader.gguf_utils import open_gguf

F32 = 0


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def gguf_bytes(tensors: list[tuple[str, tuple[int, ...], int]], alignment: int | None = None, version: int = 3,
               n_dims: int | None = None, kv: list[bytes] | None = None) -> bytes:
    """A GGUF of float32 tensors (name, dims, data offset), with `general.alignment` when
    given, `n_dims` declared for the first tensor instead of its own, and metadata `kv`."""
    kv = list(kv or []) + ([] if alignment is None else [_string("general.alignment") + struct.pack("<II", 4, alignment)])
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv)) + b"".join(kv)
    for i, (name, dims, offset) in enumerate(tensors):
        declared = len(dims) if n_dims is None or i else n_dims
        out += _string(name) + struct.pack("<I", declared) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", F32, offset)
    align = alignment or 32
    out += b"\0" * (-len(out) % align)
    return out + b"\0" * 4096


def _open(tmp_path, data: bytes):
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    return open_gguf(str(path))


def test_a_well_formed_file_reads(tmp_path) -> None:
    f = _open(tmp_path, gguf_bytes([("a", (8, 2), 0), ("b", (8,), 64)]))
    assert [t.name for t in f.tensors] == ["a", "b"]


@pytest.mark.parametrize(("data", "message"), [
    # (the rest of the file was read as dimensions: 66 s and 1.9 GB for a 500 MB file)
    (gguf_bytes([("a", (8, 2), 0)], n_dims=2**31), "2147483648 dimensions; GGUF tensors have at most 4"),
    (gguf_bytes([("a", (8,), 0)], version=4), "GGUF version 4 is not supported"),
    (gguf_bytes([("a", (8,), 0)], alignment=3), "general.alignment is 3; it must be a power of two"),
    (gguf_bytes([("a", (8,), 0)], alignment=0), "general.alignment is 0"),  # (a ZeroDivisionError)
    # (these loaded and answered nonsense, with no error)
    (gguf_bytes([("a", (8,), 4)]), "'a' starts at data offset 4, not a multiple of the alignment 32"),
    (gguf_bytes([("a", (16,), 0), ("b", (8,), 32)]), "'b' starts at data offset 32, inside the tensor before it"),
    # (each was "KeyError: 77" / "KeyError: 9")
    (gguf_bytes([("a", (8,), 0)], kv=[_string("x.y") + struct.pack("<II", 77, 0)]),
     "metadata 'x.y' has value type 77, which is not a GGUF scalar type"),
    (gguf_bytes([("a", (8,), 0)], kv=[_string("x.z") + struct.pack("<IIQ", 9, 9, 1)]),
     "metadata 'x.z' has value type 9"),
])
def test_a_malformed_layout_is_refused_by_name(tmp_path, data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        _open(tmp_path, data)
    assert "m.gguf" in str(e.value)
