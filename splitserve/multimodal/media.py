"""Image loading for requests: PIL images, encoded bytes, data: URIs, local files (file:// URLs or
paths) and http(s) URLs become RGB images, decoded in full and checked (format, pixel count, byte
size) here, so that a bad image is the caller's error with a message saying what is wrong, never the
engine's.

The server loads under the rules of its flags (vLLM's): local files only under
--allowed-local-media-path, http(s) URLs only to --allowed-media-domains when given (redirects
included), fetched with a timeout and a byte cap; the offline APIs load an offline user's own files
and URLs (MediaConfig.offline(), as LMDeploy's load_image does).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import os
import time
import urllib.parse
from dataclasses import dataclass

from PIL import Image

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")
# Pillow names JPEGs with a multi-picture header (most phone cameras write one) MPO; they are JPEGs.
_FORMAT_ALIASES = {"MPO": "JPEG"}
_MAX_REDIRECTS = 5
_CHUNK = 64 * 1024


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

    @classmethod
    def offline(cls) -> MediaConfig:
        """An offline user's rules: their own files, wherever they are, and any URL."""
        return cls(allowed_local_media_path="/")


def load_image(source, config: MediaConfig | None = None) -> Image.Image:
    """An RGB image, fully decoded, from any source a request may give (config None: offline rules)."""
    config = config or MediaConfig.offline()
    if isinstance(source, Image.Image):
        return _from_pil(source, config)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), config)
    if not isinstance(source, str):
        raise MediaError(f"an image must be a PIL image, bytes or a URL string, not {type(source).__name__}")
    scheme = _scheme(source)
    if scheme == "data":
        return _decode(_data_uri_bytes(source, config), config)
    if scheme in ("http", "https"):
        return _decode(_fetch(source, config), config)
    if scheme in ("file", ""):
        return _decode(_read_local(source, config), config)
    raise MediaError(f"URL scheme {scheme}: is not supported; send a data: URI, an http(s) URL or a file")


async def load_image_async(source, config: MediaConfig | None = None) -> Image.Image:
    """load_image off the event loop: fetching and decoding run in a worker thread."""
    # The fetch is bounded by fetch_timeout_s, so a worker thread is held no longer than that; one
    # thread for both steps keeps a single code path (and its rules) for sync and async callers.
    return await asyncio.to_thread(load_image, source, config)


def image_hash(image: Image.Image) -> str:
    """The image's identity: its RGB pixels, whatever form it came in."""
    image = _to_rgb(image)
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def encode_data_uri(image: Image.Image, format: str = "PNG") -> str:
    """A data: URI holding the image encoded in format (PNG, JPEG, WEBP, ...)."""
    if format.upper() == "JPEG" and image.mode not in ("RGB", "L"):
        image = _to_rgb(image)  # JPEG has no alpha channel: Pillow refuses to write one
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return f"data:image/{format.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _scheme(source: str) -> str:
    """The URL scheme of source, "" for a plain path."""
    if source[:5].lower() == "data:":
        return "data"
    head, sep, _ = source[:32].partition("://")
    return head.lower() if sep and head.isalnum() else ""


def _from_pil(image: Image.Image, config: MediaConfig) -> Image.Image:
    _check_pixels(image.size, config)
    try:
        image.load()  # a lazily opened file (Image.open) may still be truncated
    except Exception as exc:
        raise MediaError(f"could not be decoded as an image (truncated or corrupt data): {exc}") from None
    rgb = _to_rgb(image)
    # A copy, so that the caller changing their image later cannot change what the engine sees.
    return rgb.copy() if rgb is image else rgb


def _decode(data: bytes, config: MediaConfig) -> Image.Image:
    if len(data) > config.max_image_bytes:
        raise MediaError(f"the image is larger than the limit of {config.max_image_bytes} bytes")
    try:
        image = Image.open(io.BytesIO(data))
        _check_format(image.format)
        _check_pixels(image.size, config)  # from the header, before the pixels are decoded
        image.load()
    except MediaError:
        raise
    except Image.DecompressionBombError as exc:
        raise MediaError(f"the image has too many pixels to decode safely: {exc}") from None
    except Exception as exc:  # corrupt data makes Pillow raise almost anything; all mean the same
        raise MediaError(f"could not be decoded as an image (truncated or corrupt data): {exc}") from None
    return _to_rgb(image)


def _check_format(format: str | None) -> None:
    if _FORMAT_ALIASES.get(format, format) not in SUPPORTED_FORMATS:
        raise MediaError(f"image format {format} is not supported; send PNG, JPEG or WebP")


def _check_pixels(size: tuple[int, int], config: MediaConfig) -> None:
    width, height = size
    if width * height > config.max_image_pixels:
        raise MediaError(
            f"the image is {width} x {height} = {width * height} pixels, more than the limit of "
            f"{config.max_image_pixels}"
        )


def _to_rgb(image: Image.Image) -> Image.Image:
    """image in RGB, transparent parts on white (as transformers' convert_to_rgb does)."""
    if image.mode == "RGB":
        return image
    if not image.has_transparency_data:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _data_uri_bytes(uri: str, config: MediaConfig) -> bytes:
    header, _, payload = uri.partition(",")
    if not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise MediaError("a data URI must be data:image/<format>;base64,<data>")
    # Refused before decoding, so that an oversized payload costs no second copy of itself.
    if len(payload) // 4 * 3 > config.max_image_bytes + 2:
        raise MediaError(f"the image is larger than the limit of {config.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URI's base64 data is not valid base64") from None


def _read_local(source: str, config: MediaConfig) -> bytes:
    real = os.path.realpath(_local_path(source))  # resolves .. and symlinks before the check
    allowed = config.allowed_local_media_path
    if allowed is None:
        raise MediaError(
            "local file paths are refused: start the server with --allowed-local-media-path to allow files "
            "under a directory"
        )
    root = os.path.realpath(allowed)
    if os.path.commonpath([real, root]) != root:
        raise MediaError(f"{source} is outside the allowed local media path {allowed}")
    if not os.path.isfile(real):  # a directory, a device or a FIFO would fail or block below
        what = "it is not a regular file" if os.path.exists(real) else "there is no such file"
        raise MediaError(f"{source} cannot be read: {what}")
    try:
        with open(real, "rb") as f:
            data = f.read(config.max_image_bytes + 1)
    except OSError as exc:
        raise MediaError(f"{source} cannot be read: {exc.strerror}") from None
    if len(data) > config.max_image_bytes:
        raise MediaError(f"{source} is larger than the limit of {config.max_image_bytes} bytes")
    return data


def _local_path(source: str) -> str:
    if _scheme(source) != "file":
        return source
    parsed = urllib.parse.urlparse(source)
    if parsed.netloc not in ("", "localhost"):  # file://etc/passwd would otherwise read /passwd
        raise MediaError(f"{source} is not a local file URL; write file:///absolute/path")
    return urllib.parse.unquote(parsed.path)


def _fetch(url: str, config: MediaConfig) -> bytes:
    # requests is imported here: the engine imports this module, and only the server fetches.
    import requests
    import urllib3

    deadline = time.monotonic() + config.fetch_timeout_s
    try:
        # Redirects are followed here, not by requests, so that every hop meets the same rules.
        for _ in range(_MAX_REDIRECTS + 1):
            _check_remote(url, config, deadline)
            with requests.get(url, stream=True, timeout=config.fetch_timeout_s, allow_redirects=False) as response:
                if response.is_redirect:
                    url = urllib.parse.urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise MediaError(f"{url} answered HTTP {response.status_code}")
                return _read_capped(response, url, config, deadline)
    except (requests.Timeout, urllib3.exceptions.TimeoutError):
        raise MediaError(f"fetching {url} timed out after {config.fetch_timeout_s:g} s") from None
    except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
        raise MediaError(f"fetching {url} failed: {type(exc).__name__}") from None
    raise MediaError(f"{url} redirected more than {_MAX_REDIRECTS} times")


def _check_remote(url: str, config: MediaConfig, deadline: float) -> None:
    """Refuses url (a first URL or a redirect's) where the rules or the time left do."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https"):  # where a redirect points elsewhere
        raise MediaError(f"{url} is not an http(s) URL")
    if not config.allow_remote:
        raise MediaError("remote image URLs are disabled here; send the image as a data: URI")
    allowed = config.allowed_media_domains
    if allowed is not None and (parsed.hostname or "") not in {d.lower() for d in allowed}:
        raise MediaError(f"{parsed.hostname} is not one of the allowed media domains (--allowed-media-domains)")
    if time.monotonic() > deadline:
        raise MediaError(f"fetching {url} timed out after {config.fetch_timeout_s:g} s")


def _read_capped(response, url: str, config: MediaConfig, deadline: float) -> bytes:
    """The body, never more than the cap plus one byte of it, read before the deadline."""
    cap = config.max_image_bytes
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise MediaError(f"{url} is larger than the limit of {cap} bytes")
    # read1 returns what has arrived, where read would wait for a whole chunk (urllib3 1.x has no read1).
    read = getattr(response.raw, "read1", response.raw.read)
    data = bytearray()
    while chunk := read(min(_CHUNK, cap + 1 - len(data)), decode_content=True):
        data += chunk
        if len(data) > cap:
            raise MediaError(f"{url} is larger than the limit of {cap} bytes")
        # The timeout bounds each read; this bounds them all, against a server sending a byte at a time.
        if time.monotonic() > deadline:
            raise MediaError(f"fetching {url} timed out after {config.fetch_timeout_s:g} s")
    return bytes(data)
