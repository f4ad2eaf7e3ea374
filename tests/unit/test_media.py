"""Loading the images requests name (multimodal/media.py): every kind of source gives the same pixels
and hash, and every bad image, path or URL is a MediaError saying what is wrong; http fetches from a
loopback server: redirects under the same rules, the timeout (per read and in all) and the byte cap."""

from __future__ import annotations

import asyncio
import http.server
import io
import os
import struct
import threading
import time
import zlib

import pytest
from PIL import Image

from splitserve.multimodal.media import (
    MediaConfig,
    MediaError,
    encode_data_uri,
    image_hash,
    load_image,
    load_image_async,
)
from tests.helpers.multimodal import random_image


def encoded(image, format="PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **kwargs)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels but holds almost none: only its header is any use."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(encoded(random_image(1)))
    (root / "secret.png").write_bytes(encoded(random_image(2)))
    os.symlink(root / "secret.png", allowed / "link.png")
    os.symlink(allowed, root / "alias")
    random_image(3).save(allowed / "anim.gif")
    return root


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        route = {
            "/a.png": lambda: self._send(encoded(random_image(1))),
            "/big.png": lambda: self._send(encoded(random_image(1, (400, 400)))),
            "/slow.png": self._slow,
            "/endless": self._endless,
            "/drip": self._drip,
            "/redirect": lambda: self._redirect("/a.png"),
            "/redirect-away": lambda: self._redirect(f"http://localhost:{self.server.server_address[1]}/a.png"),
            "/loop": lambda: self._redirect("/loop"),
        }.get(self.path)
        try:
            route() if route else self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading: what the cap and timeout tests want

    def _send(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _slow(self):
        time.sleep(0.5)
        self._send(encoded(random_image(1)))

    def _endless(self):  # no Content-Length: only counting the bytes read can stop it
        self.send_response(200)
        self.end_headers()
        for _ in range(100):
            self.wfile.write(b"\0" * 65536)

    def _drip(self):  # each byte well within the per-read timeout, all of them far past it
        self.send_response(200)
        self.end_headers()
        for byte in encoded(random_image(1))[:100]:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.02)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_every_source_gives_the_same_pixels_and_hash(files, server):
    image = random_image(1)
    config = MediaConfig(allowed_local_media_path=str(files / "allowed"))
    loaded = [
        load_image(image),
        load_image(encoded(image)),
        load_image(bytearray(encoded(image, "BMP"))),
        load_image(encode_data_uri(image)),
        load_image(f"file://{files / 'allowed' / 'a.png'}", config),
        load_image(str(files / "allowed" / "a.png"), config),
        load_image(f"{server}/a.png", config),
        load_image(f"{server}/redirect", config),
    ]
    assert {image_hash(x) for x in loaded} == {image_hash(image)}
    assert all(x.mode == "RGB" and x.size == image.size for x in loaded)
    assert loaded[0] is not image  # a copy: the caller changing theirs later changes nothing here


def test_hash_is_of_pixels_and_shape():
    image = random_image(1)
    assert image_hash(random_image(2)) != image_hash(image)
    transposed = Image.frombytes("RGB", (48, 64), image.tobytes())  # the same bytes, another shape
    assert image_hash(transposed) != image_hash(image)
    assert image_hash(image.convert("RGBA")) == image_hash(image)  # opaque alpha adds nothing


def test_lossy_and_odd_encodings():
    image = random_image(1)
    for format in ("JPEG", "WEBP"):
        assert load_image(encode_data_uri(image, format)).size == (64, 48)
    # Phone cameras write JPEGs with a multi-picture header, which Pillow calls MPO.
    mpo = encoded(image, "MPO", save_all=True, append_images=[random_image(2)])
    assert Image.open(io.BytesIO(mpo)).format == "MPO" and load_image(mpo).size == (64, 48)
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))  # fully transparent: white, not black
    assert load_image(encoded(clear)).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(encoded(Image.new("L", (4, 4), 7))).getpixel((0, 0)) == (7, 7, 7)


@pytest.mark.parametrize(
    "source, words",
    [
        (b"not an image", "could not be decoded as an image"),
        (encoded(random_image(1))[:100], r"could not be decoded as an image \(truncated"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # unpadded
        ("data:text/plain;base64,aGk=", "data:image/"),
        ("data:image/png,rawbytes", "data:image/"),
        ("ftp://example.com/a.png", "URL scheme ftp: is not supported"),
        (42, "not int"),
    ],
)
def test_bad_data(source, words):
    with pytest.raises(MediaError, match=words):
        load_image(source)


def test_formats_and_the_caps(files):
    with pytest.raises(MediaError, match="image format GIF is not supported; send PNG, JPEG or WebP"):
        load_image(str(files / "allowed" / "anim.gif"))
    with pytest.raises(MediaError, match="image format TIFF is not supported"):
        load_image(encoded(random_image(1), "TIFF"))
    with pytest.raises(MediaError, match="64 x 48 = 3072 pixels, more than the limit of 1000"):
        load_image(encoded(random_image(1)), MediaConfig(max_image_pixels=1000))
    with pytest.raises(MediaError, match="more than the limit of 1000"):
        load_image(random_image(1), MediaConfig(max_image_pixels=1000))
    # From the header, before decoding: these pixels are not there, and would fail to decode.
    with pytest.raises(MediaError, match="5000 x 5000 = 25000000 pixels, more than the limit of 16777216"):
        load_image(png_header(5000, 5000))
    with pytest.raises(MediaError, match="too many pixels to decode safely"):
        load_image(png_header(100_000, 100_000), MediaConfig(max_image_pixels=10**11))
    with pytest.raises(MediaError, match="larger than the limit of 10 bytes"):
        load_image(encoded(random_image(1)), MediaConfig(max_image_bytes=10))
    with pytest.raises(MediaError, match="larger than the limit of 10 bytes"):
        load_image(encode_data_uri(random_image(1)), MediaConfig(max_image_bytes=10))
    with pytest.raises(MediaError, match="a.png is larger than the limit of 10 bytes"):
        load_image(
            str(files / "allowed" / "a.png"), MediaConfig(allowed_local_media_path=str(files), max_image_bytes=10)
        )


def test_local_files_stay_under_the_allowed_path(files):
    config = MediaConfig(allowed_local_media_path=str(files / "allowed"))
    with pytest.raises(MediaError, match="local file paths are refused: start the server with --allowed-local"):
        load_image(f"file://{files / 'allowed' / 'a.png'}", MediaConfig())
    escapes = [
        f"file://{files / 'allowed' / '..' / 'secret.png'}",
        str(files / "allowed" / ".." / "secret.png"),
        str(files / "allowed" / "link.png"),  # a symlink inside, to a file outside
        "file:///etc/passwd",
    ]
    for escape in escapes:
        with pytest.raises(MediaError, match=f"outside the allowed local media path {files / 'allowed'}"):
            load_image(escape, config)
    with pytest.raises(MediaError, match="not a local file URL"):
        load_image("file://etc/passwd", config)
    with pytest.raises(MediaError, match="missing.png cannot be read: there is no such file"):
        load_image(str(files / "allowed" / "missing.png"), config)
    with pytest.raises(MediaError, match="cannot be read: it is not a regular file"):
        load_image(str(files / "allowed"), config)
    aliased = MediaConfig(allowed_local_media_path=str(files / "alias"))  # the allowed path, a symlink
    assert load_image(str(files / "alias" / "a.png"), aliased).size == (64, 48)
    assert load_image(str(files / "secret.png")).size == (64, 48)  # offline: a user's own files


def test_remote_rules(server):
    with pytest.raises(MediaError, match="remote image URLs are disabled"):
        load_image(f"{server}/a.png", MediaConfig(allow_remote=False))
    with pytest.raises(MediaError, match="127.0.0.1 is not one of the allowed media domains"):
        load_image(f"{server}/a.png", MediaConfig(allowed_media_domains=["example.com"]))
    assert load_image(f"{server}/a.png", MediaConfig(allowed_media_domains=["127.0.0.1"])).size == (64, 48)
    # A redirect is held to the same rules as the URL the request named.
    with pytest.raises(MediaError, match="localhost is not one of the allowed media domains"):
        load_image(f"{server}/redirect-away", MediaConfig(allowed_media_domains=["127.0.0.1"]))
    with pytest.raises(MediaError, match="redirected more than 5 times"):
        load_image(f"{server}/loop")
    with pytest.raises(MediaError, match=r"/missing.png answered HTTP 404"):
        load_image(f"{server}/missing.png")


def test_fetch_caps(server):
    with pytest.raises(MediaError, match="big.png is larger than the limit of 2000 bytes"):
        load_image(f"{server}/big.png", MediaConfig(max_image_bytes=2000))
    start = time.monotonic()
    with pytest.raises(MediaError, match="endless is larger than the limit of 2000 bytes"):
        load_image(f"{server}/endless", MediaConfig(max_image_bytes=2000))
    with pytest.raises(MediaError, match=r"fetching .*/slow.png timed out after 0.2 s"):
        load_image(f"{server}/slow.png", MediaConfig(fetch_timeout_s=0.2))
    with pytest.raises(MediaError, match=r"fetching .*/drip timed out after 0.2 s"):
        load_image(f"{server}/drip", MediaConfig(fetch_timeout_s=0.2))
    assert time.monotonic() - start < 1.5


def test_async_loading(server):
    assert asyncio.run(load_image_async(f"{server}/a.png")).size == (64, 48)
    with pytest.raises(MediaError, match="HTTP 404"):
        asyncio.run(load_image_async(f"{server}/missing.png"))
    with pytest.raises(MediaError, match="not one of the allowed media domains"):
        asyncio.run(load_image_async(f"{server}/a.png", MediaConfig(allowed_media_domains=[])))
