"""Loading the images requests name: PIL images, encoded bytes, data: URIs, local files (file:// URLs or
paths) and http(s) URLs, each decoded in full and checked (format, pixel count, size) here, so that a
bad image is the caller's error with a message saying what is wrong, never the engine's.

The server loads under the rules of its flags (vLLM's): local files only under
--allowed-local-media-path, http(s) URLs only to --allowed-media-domains when given, fetched with a
timeout and a byte cap; the offline APIs load an offline user's own files and URLs
(MediaConfig.offline(), as LMDeploy's load_image does).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import os
import urllib.parse
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")


class MediaError(ValueError):
    """An image that cannot be used, with what is wrong with it."""


@dataclass
class MediaConfig:
    allowed_local_media_path: str | None = None  # local files only under this directory (None: none)
    allowed_media_domains: list[str] | None = None  # http(s) URLs only to these hosts (None: any)
    allow_remote: bool = True
    fetch_timeout_s: float = 5.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    any_local_file: bool = False  # offline: a user's own files, wherever they are

    @classmethod
    def offline(cls) -> MediaConfig:
        return cls(any_local_file=True)


def load_image(source, config: MediaConfig | None = None) -> Image.Image:
    """An RGB image, fully decoded, from any source a request may give."""
    config = config or MediaConfig.offline()
    if isinstance(source, Image.Image):
        _check_pixels(source.size, config)
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), config)
    if not isinstance(source, str):
        raise MediaError(f"an image must be a PIL image, bytes or a URL string, not {type(source).__name__}")
    if source.startswith("data:"):
        return decode_image(_data_uri_bytes(source), config)
    if source.startswith(("http://", "https://")):
        return decode_image(_fetch(source, config), config)
    return decode_image(_read_local(source, config), config)


async def load_image_async(source, config: MediaConfig | None = None) -> Image.Image:
    """load_image off the event loop: fetching and decoding run in a worker thread."""
    return await asyncio.to_thread(load_image, source, config)


def decode_image(data: bytes, config: MediaConfig) -> Image.Image:
    if len(data) > config.max_image_bytes:
        raise MediaError(f"the image is {len(data)} bytes, more than the limit of {config.max_image_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in SUPPORTED_FORMATS:
            raise MediaError(f"image format {image.format} is not supported; send PNG, JPEG or WebP")
        _check_pixels(image.size, config)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise MediaError(f"the data could not be decoded as an image (truncated or corrupt): {exc}") from None
    return image.convert("RGB")


def _check_pixels(size: tuple[int, int], config: MediaConfig) -> None:
    width, height = size
    if width * height > config.max_image_pixels:
        raise MediaError(
            f"the image is {width} x {height} = {width * height} pixels, more than the limit of "
            f"{config.max_image_pixels}"
        )


def _data_uri_bytes(uri: str) -> bytes:
    header, _, payload = uri.partition(",")
    if not header.startswith("data:image/") or ";base64" not in header:
        raise MediaError("a data URI must be data:image/<format>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URI's base64 data is not valid base64") from None


def _read_local(source: str, config: MediaConfig) -> bytes:
    path = urllib.parse.unquote(urllib.parse.urlparse(source).path) if source.startswith("file:") else source
    real = os.path.realpath(path)
    if not config.any_local_file:
        allowed = config.allowed_local_media_path
        if allowed is None:
            raise MediaError(
                "local file paths are refused: start the server with --allowed-local-media-path to allow files "
                "under a directory"
            )
        root = os.path.realpath(allowed)
        if os.path.commonpath([real, root]) != root:
            raise MediaError(f"{source} is outside the allowed local media path {allowed}")
    try:
        with open(real, "rb") as f:
            return f.read(config.max_image_bytes + 1)
    except OSError as exc:
        raise MediaError(f"{source} cannot be read: {exc.strerror}") from None


def _fetch(url: str, config: MediaConfig) -> bytes:
    import requests

    host = urllib.parse.urlparse(url).hostname or ""
    if not config.allow_remote:
        raise MediaError("remote image URLs are disabled here")
    if config.allowed_media_domains is not None and host not in config.allowed_media_domains:
        raise MediaError(f"{host} is not one of the allowed media domains (--allowed-media-domains)")
    try:
        with requests.get(url, stream=True, timeout=config.fetch_timeout_s) as response:
            if response.status_code != 200:
                raise MediaError(f"{url} answered HTTP {response.status_code}")
            data = bytearray()
            for chunk in response.iter_content(64 * 1024):
                data += chunk
                if len(data) > config.max_image_bytes:
                    raise MediaError(f"{url} is larger than the limit of {config.max_image_bytes} bytes")
            return bytes(data)
    except requests.Timeout:
        raise MediaError(f"fetching {url} timed out after {config.fetch_timeout_s:g} s") from None
    except requests.RequestException as exc:
        raise MediaError(f"fetching {url} failed: {type(exc).__name__}") from None


def image_hash(image: Image.Image) -> str:
    """The image's identity: its pixels, whatever form it came in."""
    image = image.convert("RGB")
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def encode_data_uri(image: Image.Image, format: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return f"data:image/{format.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"
