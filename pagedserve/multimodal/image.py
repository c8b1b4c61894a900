"""What a client sent as an image, turned into a checked RGB PIL image.

Every source is hostile until bounded (limits in request_limits.py): a `data:` URL or a
fetched body may hold at most MAX_IMAGE_BYTES; the header's size must be at most
MAX_IMAGE_PIXELS before any pixel is decoded, so a decompression bomb costs nothing,
and a JPEG at most MAX_JPEG_SCANS scans (each one a pass over every pixel); only PNG,
JPEG, WebP and GIF (first frame) are opened, whatever the bytes claim; a corrupt file
fails here, naming the problem, never in the model.  `http(s)` URLs are fetched only
from the domains the server names (--allowed-media-domains), never from loopback,
private or link-local addresses, within MAX_IMAGE_BYTES and IMAGE_FETCH_SECONDS; every
other scheme (`file:` included) is refused: no request field ever names a server file.

Opening (`open_image`: the bytes and the header) and decoding (`decode`) are two steps,
so that a prompt's images can wait, headers read, for room in the process's
`DECODING` budget of pixels before any of them is decoded (the engine's
InputProcessor holds it until the processor is done with them).
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagedserve.errors import ImageInputError, OverloadedError
from pagedserve.request_limits import (
    IMAGE_FETCH_SECONDS,
    IMAGE_QUEUE_SECONDS,
    MAX_DECODING_PIXELS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_JPEG_SCANS,
    MAX_WAITING_IMAGE_PROMPTS,
)

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from (ModelConfig.allowed_media_domains: None fetches nothing)."""

    allowed_domains: tuple[str, ...] | None = None
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    fetch_seconds: float = IMAGE_FETCH_SECONDS


def _error(message: str, param: str) -> ImageInputError:
    return ImageInputError(message, param=param)


class PixelBudget:
    """Pixels decoded and not yet let go of, across all requests of the process: a
    prompt holds its images' header-declared pixels from before decoding until its
    processor is done.  Prompts that find too many held wait in turn (first come, first
    served: a large one is not starved by a stream of small ones), at most `max_waiting`
    of them, each for at most `timeout` seconds; past either, OverloadedError (a 503)."""

    def __init__(self, limit: int, max_waiting: int = MAX_WAITING_IMAGE_PROMPTS) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.held = 0
        self._waiting: deque[object] = deque()  # tickets, in arrival order
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, pixels: int, timeout: float = IMAGE_QUEUE_SECONDS) -> Iterator[None]:
        """Hold `pixels` (at most the whole budget: a prompt bigger than it runs alone)
        for the block."""
        pixels = min(pixels, self.limit)
        busy = OverloadedError("other requests' images are being decoded (a bound on the pixels held at once); "
                               "retry shortly")
        with self._changed:
            if self._waiting or self.held + pixels > self.limit:
                if len(self._waiting) >= self.max_waiting:
                    raise busy
                ticket = object()
                self._waiting.append(ticket)
                try:
                    turn = self._changed.wait_for(
                        lambda: self._waiting[0] is ticket and self.held + pixels <= self.limit, timeout)
                finally:
                    self._waiting.remove(ticket)
                    self._changed.notify_all()  # (the next in line may fit now)
                if not turn:
                    raise busy
            self.held += pixels
        try:
            yield
        finally:
            with self._changed:
                self.held -= pixels
                self._changed.notify_all()


DECODING = PixelBudget(MAX_DECODING_PIXELS)


def load_image(source: Any, policy: MediaPolicy, param: str = "image") -> Any:
    """A checked RGB PIL image from a PIL image, encoded bytes, or a `data:`/`http(s)` URL."""
    return decode(open_image(source, policy, param), param)


def open_image(source: Any, policy: MediaPolicy, param: str = "image") -> Any:
    """`source`'s image with its header read and checked, its pixels not decoded yet:
    its size is `width * height`."""
    from PIL import Image

    if isinstance(source, Image.Image):
        check_pixels(source.width, source.height, policy, param)
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _open_encoded(bytes(source), policy, param)
    if isinstance(source, str):
        return _open_encoded(read_url(source, policy, param), policy, param)
    raise _error(f"an image must be a PIL image, encoded bytes or a URL, got {type(source).__name__}", param)


def check_pixels(width: int, height: int, policy: MediaPolicy, param: str) -> None:
    if width < 1 or height < 1:
        raise _error(f"the image is {width}x{height} pixels: empty", param)
    if width * height > policy.max_pixels:
        raise _error(f"the image is {width}x{height} = {width * height} pixels, more than the limit of "
                     f"{policy.max_pixels}", param)


def decode_image(data: bytes, policy: MediaPolicy, param: str = "image") -> Any:
    """Encoded bytes -> RGB PIL image: size checked from the header, then decoded."""
    return decode(_open_encoded(data, policy, param), param)


def _open_encoded(data: bytes, policy: MediaPolicy, param: str) -> Any:
    from PIL import Image, JpegImagePlugin, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise _error(f"the image is {len(data)} bytes, more than the limit of {policy.max_bytes}", param)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise _error(f"the image has more pixels than the limit of {policy.max_pixels}", param) from None
    except UnidentifiedImageError:
        raise _error(f"the image data is not a {', '.join(FORMATS)} image", param) from None
    except Exception as e:  # a header PIL cannot parse
        raise _error(f"the image data is corrupt ({type(e).__name__}: {e})", param) from None
    check_pixels(image.width, image.height, policy, param)  # before any pixel is decoded
    if isinstance(image, JpegImagePlugin.JpegImageFile):  # (an MPO too: PIL opens a JPEG with an MPF header so)
        # A scan starts at an SOS marker (FF DA), which entropy-coded data never holds (an
        # FF there is followed by 00 or a restart marker); counted in metadata too, if a
        # thumbnail's, and in every picture of an MPO: an overcount only, and the bound is
        # far past real files.
        scans = data.count(b"\xff\xda")
        if scans > MAX_JPEG_SCANS:
            raise _error(f"the JPEG has {scans} scans, more than the limit of {MAX_JPEG_SCANS} (each one a pass "
                         "over every pixel; a progressive JPEG has about ten)", param)
    try:
        image.seek(0)  # an animated GIF or WebP: its first frame
    except Exception as e:  # a frame table PIL cannot follow
        raise _error(f"the image data is corrupt ({type(e).__name__}: {e})", param) from None
    return image


def decode(image: Any, param: str = "image") -> Any:
    """An opened image decoded (a PIL image of the caller's: its current frame), as RGB
    (no copy where it is RGB already)."""
    try:
        image.load()
        return image.convert("RGB") if image.mode != "RGB" else image
    except Exception as e:  # truncated or corrupt pixel data
        raise _error(f"the image data is corrupt ({type(e).__name__}: {e})", param) from None


def read_url(url: str, policy: MediaPolicy, param: str = "image_url") -> bytes:
    """The bytes an image URL names: a base64 `data:` URL, or an allowed `http(s)` one."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url, policy, param)
    if scheme in ("http", "https"):
        return _fetch(url, policy, param)
    shown = url[:40] + ("..." if len(url) > 40 else "")
    raise _error(f"image URLs must be data: URLs (or http(s) ones where the server allows their domain), got "
                 f"{shown!r}", param)


def _read_data_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header.lower():
        raise _error("a data: URL image must be base64: data:image/png;base64,...", param)
    media = header[5:].split(";", 1)[0].strip().lower()
    if media and not media.startswith("image/"):
        raise _error(f"a data: URL image must have an image/* media type, got {media!r}", param)
    # Base64 needs 4 characters per 3 bytes: a longer payload is over the limit undecoded.
    if len(payload) > (policy.max_bytes + 2) // 3 * 4 + 4:
        raise _error(f"the image is more than the limit of {policy.max_bytes} bytes", param)
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise _error("the data: URL's base64 payload is invalid", param) from None


def _host_allowed(host: str, domains: Sequence[str]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (d.lower().lstrip(".") for d in domains))


def _public_addresses(host: str, port: int, param: str) -> None:
    """Every address the host resolves to is a public one (no loopback, private,
    link-local, reserved or multicast address: the server's own network stays closed)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise _error(f"cannot resolve the image URL's host {host!r} ({e})", param) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global or address.is_multicast:
            raise _error(f"the image URL's host {host!r} resolves to a non-public address", param)


def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    import httpx

    domains = policy.allowed_domains
    if not domains:
        raise _error("this server fetches no image URLs: send the image as a data: URL (the server's "
                     "--allowed-media-domains lets it fetch from named domains)", param)
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    if not _host_allowed(host, domains):
        raise _error(f"the image URL's host {host!r} is not among the allowed media domains", param)
    _public_addresses(host, parsed.port or (443 if parsed.scheme == "https" else 80), param)
    deadline = time.monotonic() + policy.fetch_seconds
    chunks: list[bytes] = []
    size = 0
    try:
        with httpx.Client(timeout=policy.fetch_seconds, follow_redirects=False) as client, \
                client.stream("GET", url) as response:
            if response.status_code != 200:
                raise _error(f"fetching the image URL gave HTTP {response.status_code}", param)
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise _error(f"the image is more than the limit of {policy.max_bytes} bytes", param)
                if time.monotonic() > deadline:
                    raise _error(f"fetching the image took more than {policy.fetch_seconds:g} s", param)
                chunks.append(chunk)
    except httpx.HTTPError as e:
        raise _error(f"fetching the image URL failed ({type(e).__name__})", param) from None
    return b"".join(chunks)
