"""Loading a client's image within the bounds (multimodal/image.py): every refusal is an
ImageInputError naming the problem, before any pixel of a bomb is decoded."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image as PIL

from pagedserve.errors import ImageInputError
from pagedserve.multimodal.image import (
    MediaPolicy,
    decode,
    decode_image,
    load_image,
    open_image,
    read_url,
    upright_size,
)


def encoded(fmt: str, size: tuple[int, int] = (20, 10), frames: int = 1) -> bytes:
    images = [PIL.new("RGB", size, (40 * i, 200, 10)) for i in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, format=fmt, save_all=frames > 1, append_images=images[1:])
    return buf.getvalue()


def noise_png() -> bytes:
    import numpy as np

    buf = io.BytesIO()
    PIL.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels and whose data is a few bytes: a
    decompression bomb's shape (the size is read before anything is decoded)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_loads_as_rgb(fmt: str) -> None:
    image = load_image(data_url(encoded(fmt), f"image/{fmt.lower()}"), MediaPolicy())
    assert image.mode == "RGB" and image.size == (20, 10)


def test_an_animated_gif_gives_its_first_frame() -> None:
    image = decode_image(encoded("GIF", frames=3), MediaPolicy())
    assert image.size == (20, 10) and image.getpixel((0, 0))[0] == 0


def test_a_photo_stored_sideways_is_turned_upright_by_its_exif_orientation() -> None:
    """A phone stores a portrait photo landscape with Orientation 6 (rotate 90 degrees
    clockwise to view): the model saw it sideways; transformers' load_image turns it."""
    from PIL import ImageOps

    stored = PIL.new("RGB", (60, 30), (200, 10, 10))
    stored.paste((10, 10, 200), (0, 0, 10, 30))  # a blue band on the stored image's left
    exif = PIL.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", exif=exif, quality=95)
    image = load_image(data_url(buf.getvalue(), "image/jpeg"), MediaPolicy())
    assert image.size == (30, 60)  # upright: portrait
    reference = ImageOps.exif_transpose(PIL.open(io.BytesIO(buf.getvalue()))).convert("RGB")
    assert list(image.getdata()) == list(reference.getdata())
    # the size a prompt's image rows are counted from, before decoding, is the upright one
    opened = open_image(buf.getvalue(), MediaPolicy())
    assert opened.size == (60, 30) and upright_size(opened) == (30, 60) == decode(opened).size
    # a PNG's orientation is not read by decoding it (its getexif() loads the pixels):
    # an image that cannot fit is refused before any pixel is decoded
    png_bytes = io.BytesIO()
    PIL.new("RGB", (300, 200)).save(png_bytes, format="PNG")
    png = open_image(png_bytes.getvalue(), MediaPolicy())
    assert upright_size(png) == (300, 200) and png._im is None
    # a caller's PIL image stands as it is (as vLLM takes one)
    own = PIL.open(io.BytesIO(buf.getvalue()))
    assert upright_size(own) == (60, 30) == decode(own).size


def test_base64_as_tools_and_clients_write_it_is_read() -> None:
    """Line-wrapped (the base64 tool's and MIME's 76 columns), URL-safe or unpadded
    base64 is the same image (each was "the image's base64 data is invalid")."""
    data = noise_png()
    plain = base64.b64encode(data).decode()
    for payload in (base64.encodebytes(data).decode(), base64.urlsafe_b64encode(data).decode(), plain.rstrip("=")):
        image = load_image(f"data:image/png;base64,{payload}", MediaPolicy())
        assert image.tobytes() == PIL.open(io.BytesIO(data)).convert("RGB").tobytes()


@pytest.mark.parametrize("source, match", [
    (data_url(png_header_only(5000, 5000)), "5000x5000 = 25000000 pixels, more than the limit"),
    (data_url(png_header_only(100_000, 100_000)), "more pixels than the limit"),
    (data_url(b"not an image at all"), "not a PNG"),
    (data_url(noise_png()[:400]), "corrupt"),
    ("data:image/png;base64,@@@@", "base64 data is invalid"),
    (data_url(png_header_only(16385, 1)), "16385x1 pixels, a side longer than the limit of 16384"),
    (PIL.new("La", (4, 4)), "mode 'La' cannot be converted to RGB"),
    ("data:text/plain;base64,aGVsbG8=", "image/\\* media type"),
    ("data:image/png,rawtext", "must be base64"),
    ("file:///etc/passwd", "must be data: URLs"),
    ("/etc/passwd", "must be data: URLs"),
    ("http://example.com/cat.png", "fetches no image URLs"),
    (b"\x00" * 10, "not a PNG"),
    (3, "must be a PIL image"),
])
def test_hostile_images_are_refused_by_name(source, match: str) -> None:
    with pytest.raises(ImageInputError, match=match):
        load_image(source, MediaPolicy())


def test_byte_and_pixel_limits() -> None:
    small = MediaPolicy(max_bytes=100, max_pixels=50)
    with pytest.raises(ImageInputError, match="more than the limit of 100"):
        read_url(data_url(b"x" * 1000), small)
    with pytest.raises(ImageInputError, match="200 pixels, more than the limit of 50"):
        load_image(PIL.new("RGB", (20, 10)), small)


def test_fetching_is_limited_to_allowed_public_domains() -> None:
    policy = MediaPolicy(allowed_domains=("example.com",))
    with pytest.raises(ImageInputError, match="not among the allowed media domains"):
        read_url("https://evil.org/x.png", policy)
    local = MediaPolicy(allowed_domains=("localhost", "127.0.0.1"))
    for url in ("http://localhost:8000/x.png", "http://127.0.0.1/x.png"):
        with pytest.raises(ImageInputError, match="non-public address"):
            read_url(url, local)


@pytest.mark.parametrize("url, match", [
    ("http://example.com\n@evil.org/x.png", "whitespace or a control character"),
    ("http://example.com:99999/x.png", "malformed"),
    ("http://[::1/x.png", "malformed"),
    ("http://user:pw@example.com/x.png", "credentials"),
    ("http:///x.png", "names no host"),
])
def test_malformed_image_urls_are_refused_by_name(url: str, match: str) -> None:
    with pytest.raises(ImageInputError, match=match):
        read_url(url, MediaPolicy(allowed_domains=("example.com",)))


class _Server:
    """A local HTTP server answering every GET with `body` in `pieces`, `gap` s apart
    (without a Content-Length where `sized` is false: the body ends when the connection
    does); `hits` counts the requests it saw."""

    def __init__(self, body: bytes, pieces: int = 1, gap: float = 0.0, headers: dict[str, str] | None = None,
                 sized: bool = True) -> None:
        import http.server
        import threading
        import time

        outer = self
        self.hits = 0
        self.asked: list[dict[str, str]] = []  # each request's headers

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                outer.hits += 1
                outer.asked.append({k.lower(): v for k, v in self.headers.items()})
                self.send_response(200)
                if sized:
                    self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                step = max(1, len(body) // pieces)
                try:
                    for i in range(0, len(body), step):
                        self.wfile.write(body[i: i + step])
                        self.wfile.flush()
                        time.sleep(gap)
                except OSError:
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_fetch_connects_to_the_address_it_checked(monkeypatch) -> None:
    """DNS rebinding: the host resolves once, to a public address, and the connection goes
    there; a second lookup answering loopback is never made, so the local server behind it
    is never reached."""
    import ipaddress
    import socket

    server = _Server(encoded("PNG"))
    lookups: list[str] = []
    real_lookup, real_address = socket.getaddrinfo, ipaddress.ip_address

    def rebinding(host, port, *args, **kwargs):
        if host != "pub.example.com":
            return real_lookup(host, port, *args, **kwargs)
        lookups.append(host)
        address = "192.0.2.1" if len(lookups) == 1 else "127.0.0.1"  # public, then loopback
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    class Public(ipaddress.IPv4Address):
        is_global = True

    def ip_address(value):  # TEST-NET-1 (192.0.2.0/24, for documentation) taken as public here
        return Public(value) if str(value).startswith("192.0.2.") else real_address(value)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(ipaddress, "ip_address", ip_address)
    try:
        with pytest.raises(ImageInputError, match="fetching the image URL"):
            read_url(f"http://pub.example.com:{server.port}/x.png",
                     MediaPolicy(allowed_domains=("example.com",), fetch_seconds=1.0))
    finally:
        server.close()
    assert lookups == ["pub.example.com"] and server.hits == 0


@pytest.mark.parametrize("sized", [True, False])
def test_a_trickling_image_url_is_cut_off_at_the_prompts_deadline(monkeypatch, sized: bool) -> None:
    """One deadline for all of a prompt's fetches, enforced while a read waits: a server
    sending a piece every 0.9 s is cut off when it passes, not a read later, and the
    refusal says so (without a Content-Length, the cut connection's reads ended as the
    whole body's would, and the pieces read so far were refused as a corrupt image)."""
    import time

    from pagedserve.multimodal import image as image_module

    server = _Server(encoded("PNG"), pieces=20, gap=0.9, sized=sized)  # (each read within a 1 s read timeout)
    monkeypatch.setattr(image_module, "_public_address", lambda *args: "127.0.0.1")
    policy = MediaPolicy(allowed_domains=("example.com",), fetch_seconds=1.0)
    start = time.monotonic()
    try:
        with pytest.raises(ImageInputError, match="took more than 1 s"):
            read_url(f"http://img.example.com:{server.port}/x.png", policy, deadline=start + 1.0)
        assert time.monotonic() - start < 1.4
        fast = _Server(encoded("PNG"))
        try:
            monkeypatch.setattr(image_module, "_public_address", lambda *args: "127.0.0.1")
            assert read_url(f"http://img.example.com:{fast.port}/x.png", policy) == encoded("PNG")
            assert fast.hits == 1
        finally:
            fast.close()
    finally:
        server.close()


def test_a_compressed_body_is_neither_asked_for_nor_inflated(monkeypatch) -> None:
    """httpx asked for gzip and inflated each read before its size was counted: a 1 MB gzip
    of zeros was 64 MB a read.  The fetch asks for the bytes as they are and refuses a
    body sent compressed anyway."""
    import gzip

    from pagedserve.multimodal import image as image_module

    monkeypatch.setattr(image_module, "_public_address", lambda *args: "127.0.0.1")
    policy = MediaPolicy(allowed_domains=("example.com",))
    server = _Server(gzip.compress(b"\0" * (1 << 24)), headers={"Content-Encoding": "gzip"})
    try:
        with pytest.raises(ImageInputError, match=r"sent it compressed \(Content-Encoding: gzip\)"):
            read_url(f"http://img.example.com:{server.port}/x.png", policy)
        assert server.asked[0]["accept-encoding"] == "identity"
    finally:
        server.close()


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("64:ff9b::808:808", True),
    ("127.0.0.1", False), ("::1", False), ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False),
    ("64:ff9b::7f00:1", False), ("64:ff9b::a9fe:a9fe", False), ("64:ff9b:1::a00:1", False),
    ("2002:7f00:1::", False), ("2002:a9fe:a9fe::1", False), ("ff02::1", False),
])
def test_an_address_is_public_with_every_ipv4_address_it_carries(address: str, public: bool) -> None:
    """Python counts NAT64 (64:ff9b::7f00:1) and 6to4 (2002:7f00:1::) addresses global:
    behind such a gateway they reach loopback or the cloud's metadata address."""
    import ipaddress

    from pagedserve.multimodal import image as image_module

    assert image_module.is_public_address(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_lies_on_white_as_hfs_processors_put_it(mode: str) -> None:
    """PIL's conversion to RGB dropped the alpha channel: transparent pixels showed the
    colour under them (black here), another picture than HF's and vLLM's."""
    import numpy as np

    rgba = PIL.new("RGBA", (4, 2), (0, 0, 0, 0))
    rgba.paste((200, 30, 30, 255), (2, 0, 4, 2))  # the right half opaque red, the left transparent black
    if mode == "P":
        image = rgba.convert("RGB").quantize(colors=4)
        black = image.getpixel((0, 0))
        image.info["transparency"] = black
    else:
        image = rgba.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    pixels = np.asarray(load_image(data_url(buf.getvalue()), MediaPolicy()))
    assert (pixels[:, :2] == 255).all(), pixels[:, :2]
    assert (pixels[:, 2:] == pixels[0, 3]).all() and pixels[0, 3].tolist() != [255, 255, 255]


def scan_bomb(extra_scans: int) -> bytes:
    """A small progressive JPEG with its first scan's header repeated `extra_scans` times
    before the end: each repeat is one more pass over every pixel for the decoder."""
    buf = io.BytesIO()
    PIL.new("L", (64, 64), 90).save(buf, format="JPEG", progressive=True)
    data = buf.getvalue()
    sos = data.index(b"\xff\xda")
    header = data[sos: sos + 2 + int.from_bytes(data[sos + 2: sos + 4], "big")]
    return data[:-2] + header * extra_scans + data[-2:]


def test_a_jpeg_of_many_scans_is_refused_before_decoding() -> None:
    """A 1 MB file of 100,000 empty scans took 84 s to decode at 4096x4096: the pixel
    bound does not see it, the scan bound does (and a real progressive JPEG passes)."""
    from pagedserve.request_limits import MAX_JPEG_SCANS

    buf = io.BytesIO()
    PIL.new("RGB", (64, 64), (1, 2, 3)).save(buf, format="JPEG", progressive=True)
    assert decode_image(buf.getvalue(), MediaPolicy()).size == (64, 64)
    with pytest.raises(ImageInputError, match=f"scans, more than the limit of {MAX_JPEG_SCANS}"):
        decode_image(scan_bomb(MAX_JPEG_SCANS + 10), MediaPolicy())
    # A multi-picture file (as phones save): PIL opens a JPEG with an MPF header as an
    # MPO, and the bound holds the same.
    buf = io.BytesIO()
    PIL.new("L", (64, 64), 90).save(buf, "MPO", save_all=True, append_images=[PIL.new("L", (8, 8), 7)],
                                    progressive=True)
    mpo = buf.getvalue()
    end, sos = mpo.index(b"\xff\xd9"), mpo.index(b"\xff\xda")
    header = mpo[sos: sos + 2 + int.from_bytes(mpo[sos + 2: sos + 4], "big")]
    bomb = mpo[:end] + header * (MAX_JPEG_SCANS + 10) + mpo[end:]
    assert PIL.open(io.BytesIO(bomb)).format == "MPO"
    with pytest.raises(ImageInputError, match="scans, more than the limit"):
        decode_image(bomb, MediaPolicy())


def test_a_callers_pil_image_is_used_as_it_stands() -> None:
    """Offline, an animated image the caller positioned keeps its frame (encoded images
    give their first)."""
    gif = PIL.open(io.BytesIO(encoded("GIF", frames=3)))
    gif.seek(2)
    assert load_image(gif, MediaPolicy()).getpixel((0, 0))[0] == 80 and gif.tell() == 2


def test_the_pixel_budget_makes_prompts_wait_in_turn_and_gives_up_with_a_503() -> None:
    """Pixels held from decoding to the processor's end are bounded across requests: a
    prompt waits for room in arrival order (a small one that would fit does not pass a
    large one waiting), gets OverloadedError when none comes in time or when too many
    already wait (each waiter holds a prepare thread), and one bigger than the whole
    budget still runs (alone)."""
    import threading
    import time

    from pagedserve.errors import OverloadedError
    from pagedserve.multimodal.image import PixelBudget

    budget = PixelBudget(100, max_waiting=2)
    events: list[tuple[str, int]] = []

    def prompt(name: str, pixels: int) -> threading.Thread:
        def run() -> None:
            with budget.hold(pixels, timeout=5):
                events.append((name, budget.held))
                time.sleep(0.05)
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.1)  # (queued before the next one arrives)
        return thread

    with budget.hold(60):
        with pytest.raises(OverloadedError, match="retry shortly"), budget.hold(50, timeout=0.05):
            pass
        waiters = [prompt("large", 50), prompt("small", 30)]  # small would fit now: it waits its turn
        with pytest.raises(OverloadedError, match="retry shortly"), budget.hold(1, timeout=5):
            pass  # a third waiter: refused at once
        events.append(("first done", budget.held))
    for thread in waiters:
        thread.join(5)
    assert events == [("first done", 60), ("large", 50), ("small", 80)] and budget.held == 0
    with budget.hold(10**9, timeout=0.05):  # more than the whole budget: runs alone
        assert budget.held == 100
    assert budget.held == 0
