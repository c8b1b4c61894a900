"""What a client sent as an image, turned into a checked RGB PIL image.

Every source is hostile until bounded (limits in request_limits.py): a `data:` URL or a
fetched body may hold at most MAX_IMAGE_BYTES; the header's size must be at most
MAX_IMAGE_PIXELS, and MAX_IMAGE_SIDE either way, before any pixel is decoded, so a
decompression bomb costs nothing,
and a JPEG at most MAX_JPEG_SCANS scans (each one a pass over every pixel); only PNG,
JPEG, WebP and GIF (first frame) are opened, whatever the bytes claim; a corrupt file
fails here, naming the problem, never in the model.  `http(s)` URLs are fetched only
from the domains the server names (--allowed-media-domains), never from loopback,
private or link-local addresses (the host is resolved once and the connection goes to
the address checked: a second lookup cannot answer otherwise), within MAX_IMAGE_BYTES
each and IMAGE_FETCH_SECONDS for all of a prompt's images; every other scheme (`file:`
included) is refused: no request field ever names a server file.

Opening (`open_image`: the bytes and the header) and decoding (`decode`) are two steps,
so that a prompt's images can wait, headers read, for room in the process's
`DECODING` budget of pixels before any of them is decoded (the engine's
InputProcessor holds it until the processor is done with them).
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import io
import ipaddress
import re
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
    MAX_IMAGE_SIDE,
    MAX_JPEG_SCANS,
    MAX_WAITING_IMAGE_PROMPTS,
)

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# The characters base64 image data may have: both alphabets (standard, URL-safe), padding,
# line breaks (_read_data_url takes all of them).
BASE64_TEXT = re.compile(r"[A-Za-z0-9+/=_\-\s]*")


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from (ModelConfig.allowed_media_domains: None fetches nothing)."""

    allowed_domains: tuple[str, ...] | None = None
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_side: int = MAX_IMAGE_SIDE
    fetch_seconds: float = IMAGE_FETCH_SECONDS  # for all of one prompt's images

    def fetch_deadline(self) -> float:
        """The time.monotonic() by which a prompt's images must have been fetched."""
        return time.monotonic() + self.fetch_seconds


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


def open_image(source: Any, policy: MediaPolicy, param: str = "image", deadline: float | None = None) -> Any:
    """`source`'s image with its header read and checked, its pixels not decoded yet:
    its size is `width * height`.  `deadline`: the time.monotonic() by which a URL's
    fetch must be done (one for all of a prompt's images; None: the policy's time from now)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        check_pixels(source.width, source.height, policy, param)
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _open_encoded(bytes(source), policy, param)
    if isinstance(source, str):
        return _open_encoded(read_url(source, policy, param, deadline), policy, param)
    raise _error(f"an image must be a PIL image, encoded bytes or a URL, got {type(source).__name__}", param)


def check_pixels(width: int, height: int, policy: MediaPolicy, param: str) -> None:
    if width < 1 or height < 1:
        raise _error(f"the image is {width}x{height} pixels: empty", param)
    if width * height > policy.max_pixels:
        raise _error(f"the image is {width}x{height} = {width * height} pixels, more than the limit of "
                     f"{policy.max_pixels}", param)
    if max(width, height) > policy.max_side:
        raise _error(f"the image is {width}x{height} pixels, a side longer than the limit of {policy.max_side}",
                     param)


def decode_image(data: bytes, policy: MediaPolicy, param: str = "image") -> Any:
    """Encoded bytes -> RGB PIL image: size checked from the header, then decoded."""
    return decode(_open_encoded(data, policy, param), param)


# In an image's `info`: this module opened it from encoded bytes, so its EXIF orientation
# applies (a phone stores a portrait photo sideways with an orientation tag: the model saw
# it sideways; transformers' load_image turns it too).  A caller's PIL image stands as it is.
_OPENED_HERE = "pagedserve_opened"
_QUARTER_TURNS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def _orientation(image: Any) -> int:
    """Its EXIF orientation (1: upright; also for an unreadable tag, as viewers take it)."""
    if not image.info.get(_OPENED_HERE) or "exif" not in image.info:  # (PNG's getexif() decodes the pixels first)
        return 1
    try:
        turn = image.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - malformed EXIF: shown as stored
        return 1
    return turn if isinstance(turn, int) and 1 <= turn <= 8 else 1


def upright_size(image: Any) -> tuple[int, int]:
    """(width, height) of an opened image as decode() will give it: turned upright."""
    return (image.height, image.width) if _orientation(image) in _QUARTER_TURNS else (image.width, image.height)


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
    image.info[_OPENED_HERE] = True
    return image


def decode(image: Any, param: str = "image") -> Any:
    """An opened image decoded (a PIL image of the caller's: its current frame), upright
    (upright_size), as RGB (no copy where it is RGB already).  Transparency lies on white, as HF's processors
    (`convert_to_rgb`) and vLLM put it: PIL's own conversion drops the alpha channel and
    shows whatever colour the transparent pixels hold (black, often), another picture."""
    try:
        image.load()
        if _orientation(image) != 1:
            from PIL import ImageOps

            image = ImageOps.exif_transpose(image)
    except Exception as e:  # truncated or corrupt pixel data
        raise _error(f"the image data is corrupt ({type(e).__name__}: {e})", param) from None
    if image.mode == "RGB":
        return image
    try:
        if image.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in image.info:
            from PIL import Image

            rgba = image.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return image.convert("RGB")
    except Exception as e:  # a caller's PIL image in a mode PIL converts no further ("La", ...)
        raise _error(f"an image in PIL mode {image.mode!r} cannot be converted to RGB ({type(e).__name__}: {e})",
                     param) from None


def read_url(url: str, policy: MediaPolicy, param: str = "image_url", deadline: float | None = None) -> bytes:
    """The bytes an image URL names: a base64 `data:` URL, or an allowed `http(s)` one
    (fetched by `deadline`, a time.monotonic(); None: the policy's time from now)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url, policy, param)
    if scheme in ("http", "https"):
        return _fetch(url, policy, param, policy.fetch_deadline() if deadline is None else deadline)
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
    # Line-wrapped base64 (the `base64` tool's 76-column output, MIME's) and the URL-safe
    # alphabet are base64 too; unpadded, it is padded.
    payload = "".join(payload.split()).replace("-", "+").replace("_", "/")
    # Base64 needs 4 characters per 3 bytes: a longer payload is over the limit undecoded.
    if len(payload) > (policy.max_bytes + 2) // 3 * 4 + 4:
        raise _error(f"the image is more than the limit of {policy.max_bytes} bytes", param)
    try:
        return base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _error("the image's base64 data is invalid (base64's characters, 4 for every 3 bytes)",
                     param) from None


def _host_allowed(host: str, domains: Sequence[str]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (d.lower().lstrip(".") for d in domains))


# Name lookups of image URLs' hosts: getaddrinfo cannot be interrupted, so it runs here
# and a fetch waits for it at most until its deadline (a hung lookup holds one of these
# threads, never a request's).
_RESOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="image-dns")


def _public_address(host: str, port: int, param: str, deadline: float) -> str:
    """The address to connect to: the host resolved once, by `deadline`, and every address
    it has a public one (no loopback, private, link-local, reserved or multicast address:
    the server's own network stays closed)."""
    lookup = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise _error(f"resolving the image URL's host {host!r} took too long", param) from None
    except (OSError, UnicodeError) as e:
        raise _error(f"cannot resolve the image URL's host {host!r} ({e})", param) from None
    for info in infos:
        if not is_public_address(ipaddress.ip_address(info[4][0])):
            raise _error(f"the image URL's host {host!r} resolves to a non-public address", param)
    if not infos:
        raise _error(f"the image URL's host {host!r} has no address", param)
    return str(infos[0][4][0])


# NAT64's prefixes (RFC 6052's well-known one, RFC 8215's local one): the last 32 bits are
# the IPv4 address a gateway connects to.
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


def is_public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Global and not multicast, and so is every IPv4 address an IPv6 one carries (mapped,
    6to4, Teredo, NAT64): Python counts 64:ff9b::7f00:1 or 2002:7f00:1:: global, which
    a gateway turns into loopback."""
    if not address.is_global or address.is_multicast:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        inner = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
        inner += [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) for net in _NAT64 if address in net]
        return all(is_public_address(v4) for v4 in inner if v4 is not None)
    return True


def _split_url(url: str, param: str) -> urllib.parse.SplitResult:
    """An http(s) image URL's parts, refused where it is malformed or names credentials."""
    shown = url[:100]
    if any(ord(c) <= 32 or ord(c) == 127 for c in url):
        raise _error(f"the image URL {shown!r} holds whitespace or a control character", param)
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # (raises for a port out of range)
    except ValueError as e:
        raise _error(f"the image URL {shown!r} is malformed ({e})", param) from None
    if not parts.hostname:
        raise _error(f"the image URL {shown!r} names no host", param)
    if parts.username is not None or parts.password is not None:
        raise _error("image URLs with credentials (user@host) are not fetched", param)
    return parts


def _fetch(url: str, policy: MediaPolicy, param: str, deadline: float) -> bytes:
    """GET the URL from the address its host was checked at (the Host header and TLS
    name stay the host's), by `deadline`: the connection and the headers within the time
    left, the body's reads cut off when it passes (the socket is shut down under them)."""
    import httpx

    domains = policy.allowed_domains
    if not domains:
        raise _error("this server fetches no image URLs: send the image as a data: URL (the server's "
                     "--allowed-media-domains lets it fetch from named domains)", param)
    parts = _split_url(url, param)
    host = parts.hostname or ""
    if not _host_allowed(host, domains):
        raise _error(f"the image URL's host {host!r} is not among the allowed media domains", param)
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    address = _public_address(host, port, param, deadline)
    pinned = urllib.parse.urlunsplit((parts.scheme, f"[{address}]:{port}" if ":" in address else f"{address}:{port}",
                                      parts.path or "/", parts.query, ""))
    # (identity: a compressed body would be inflated a read at a time before its size is
    # counted, a 1 MB gzip of zeros 64 MB a read; the raw bytes are what is counted)
    headers = {"Host": parts.netloc, "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": host} if parts.scheme.lower() == "https" else {}
    chunks: list[bytes] = []
    size = 0
    late = _error(f"fetching the image URLs took more than {policy.fetch_seconds:g} s", param)
    left = deadline - time.monotonic()
    if left <= 0:
        raise late
    try:
        with httpx.Client(timeout=left, follow_redirects=False, trust_env=False) as client, \
                client.stream("GET", pinned, headers=headers, extensions=extensions) as response:
            if response.status_code != 200:
                raise _error(f"fetching the image URL gave HTTP {response.status_code}", param)
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise _error(f"the image URL's server sent it compressed (Content-Encoding: {encoding[:40]}), "
                             "which was not asked for", param)
            cutoff = threading.Timer(max(0.0, deadline - time.monotonic()), _shut_down,
                                     (response.extensions.get("network_stream"),))
            cutoff.start()
            try:
                for chunk in response.iter_raw():
                    size += len(chunk)
                    if size > policy.max_bytes:
                        raise _error(f"the image is more than the limit of {policy.max_bytes} bytes", param)
                    if time.monotonic() > deadline:
                        raise late
                    chunks.append(chunk)
            finally:
                cutoff.cancel()
    except (httpx.HTTPError, httpx.InvalidURL, OSError) as e:
        if time.monotonic() > deadline:
            raise late from None
        raise _error(f"fetching the image URL failed ({type(e).__name__})", param) from None
    if time.monotonic() > deadline:  # (the cutoff's shutdown ends the body's reads as its end would)
        raise late
    return b"".join(chunks)


def _shut_down(stream: Any) -> None:
    """Cut a response's connection (its deadline passed): a read blocked on it returns."""
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
