"""Loading the images requests name (multimodal/media.py): every kind of source gives the same pixels
and hash, and every bad image, path or URL is a MediaError saying what is wrong; http fetches from a
loopback server, with the timeout and the byte cap."""

from __future__ import annotations

import asyncio
import http.server
import io
import os
import threading
import time

import pytest

from splitserve.multimodal.media import (
    MediaConfig,
    MediaError,
    encode_data_uri,
    image_hash,
    load_image,
    load_image_async,
)
from tests.helpers.multimodal import random_image


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes(random_image(1)))
    (root / "secret.png").write_bytes(png_bytes(random_image(2)))
    os.symlink(root / "secret.png", allowed / "link.png")
    random_image(3).save(allowed / "anim.gif")
    return root


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(1.0)
        if self.path not in ("/a.png", "/big.png", "/slow.png"):
            self.send_error(404)
            return
        body = png_bytes(random_image(1, (400, 400) if self.path == "/big.png" else (64, 48)))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_every_source_gives_the_same_pixels_and_hash(files, server):
    image = random_image(1)
    config = MediaConfig(allowed_local_media_path=str(files / "allowed"))
    loaded = [
        load_image(image),
        load_image(png_bytes(image)),
        load_image(encode_data_uri(image)),
        load_image(encode_data_uri(image, "WEBP"), MediaConfig()),
        load_image(f"file://{files / 'allowed' / 'a.png'}", config),
        load_image(str(files / "allowed" / "a.png"), config),
        load_image(f"{server}/a.png", config),
    ]
    hashes = {image_hash(x) for i, x in enumerate(loaded) if i != 3}  # WebP is lossy
    assert hashes == {image_hash(image)} and image_hash(random_image(2)) != image_hash(image)
    assert all(x.mode == "RGB" and x.size == image.size for x in loaded)


@pytest.mark.parametrize(
    "source, words",
    [
        (b"not an image", "could not be decoded"),
        (png_bytes(random_image(1))[:100], "could not be decoded"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "data:image/"),
        (42, "not int"),
    ],
)
def test_bad_data(source, words):
    with pytest.raises(MediaError, match=words):
        load_image(source)


def test_formats_and_the_pixel_cap(files):
    with pytest.raises(MediaError, match="GIF is not supported"):
        load_image(str(files / "allowed" / "anim.gif"))
    with pytest.raises(MediaError, match="64 x 48 = 3072 pixels, more than the limit of 1000"):
        load_image(png_bytes(random_image(1)), MediaConfig(max_image_pixels=1000))
    with pytest.raises(MediaError, match="more than the limit of 1000"):
        load_image(random_image(1), MediaConfig(max_image_pixels=1000))
    with pytest.raises(MediaError, match="bytes, more than the limit of 10 bytes"):
        load_image(png_bytes(random_image(1)), MediaConfig(max_image_bytes=10))


def test_local_files_stay_under_the_allowed_path(files):
    config = MediaConfig(allowed_local_media_path=str(files / "allowed"))
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_image(f"file://{files / 'allowed' / 'a.png'}", MediaConfig())
    for escape in (f"file://{files / 'allowed' / '..' / 'secret.png'}", str(files / "allowed" / "link.png")):
        with pytest.raises(MediaError, match="outside the allowed local media path"):
            load_image(escape, config)
    with pytest.raises(MediaError, match="cannot be read"):
        load_image(str(files / "allowed" / "missing.png"), config)
    assert load_image(str(files / "secret.png")).size == (64, 48)  # offline: a user's own files


def test_remote_fetch_rules(server):
    with pytest.raises(MediaError, match="disabled"):
        load_image(f"{server}/a.png", MediaConfig(allow_remote=False))
    with pytest.raises(MediaError, match="not one of the allowed media domains"):
        load_image(f"{server}/a.png", MediaConfig(allowed_media_domains=["example.com"]))
    assert load_image(f"{server}/a.png", MediaConfig(allowed_media_domains=["127.0.0.1"])).size == (64, 48)
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server}/missing.png")
    with pytest.raises(MediaError, match="larger than the limit of 2000 bytes"):
        load_image(f"{server}/big.png", MediaConfig(max_image_bytes=2000))
    with pytest.raises(MediaError, match="timed out after 0.2 s"):
        load_image(f"{server}/slow.png", MediaConfig(fetch_timeout_s=0.2))


def test_async_loading(server):
    assert asyncio.run(load_image_async(f"{server}/a.png")).size == (64, 48)
    with pytest.raises(MediaError, match="HTTP 404"):
        asyncio.run(load_image_async(f"{server}/missing.png"))
