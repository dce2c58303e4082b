"""Images from where a request says they are: a `data:` URL, a local file under an allowed folder, or
an http(s) URL on an allowed host; decoded by Pillow, with the checks a server needs before it spends
memory on an image.

    policy = MediaPolicy(allowed_local_media_path=Path("/srv/images"))
    image = load_image("data:image/png;base64,iVBORw0...", policy)  # a PIL image, first frame, loaded

Every refusal is a MediaError (a ValueError) saying what is wrong and what to do. The size checks come
before the pixels are decoded: the encoded bytes against `max_image_bytes`, then the header's width x
height against `max_image_pixels` (a small PNG can declare a 50,000 x 50,000 image: a decompression
bomb). Pillow is imported on first use, so a text-only server never loads it.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, unquote_to_bytes, urlsplit

if TYPE_CHECKING:
    from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what Pillow may decode a request's image as
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
FETCH_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """An image a request names that cannot be used."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be (vLLM's --allowed-local-media-path and
    --allowed-media-domains; with neither, only `data:` URLs)."""

    allowed_local_media_path: Path | None = None
    allowed_media_domains: frozenset[str] = field(default_factory=frozenset)
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    fetch_timeout_s: float = FETCH_TIMEOUT_S


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    """The image at `url`, decoded (a GIF's first frame), or a MediaError."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, policy)
    elif scheme == "file":
        data = _local_file_bytes(url, policy)
    elif scheme in ("http", "https"):
        data = _fetched_bytes(url, policy)
    else:
        raise MediaError(
            f"an image URL must be a data: URL (data:image/png;base64,...), file:// or http(s)://; got "
            f"{_shown(url)}"
        )
    return decode_image(data, policy)


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Encoded image bytes as a loaded PIL image, after the size checks (module docstring)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_image_bytes:
        raise MediaError(f"the image is {len(data)} bytes, over the limit of {policy.max_image_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as error:
        limit = policy.max_image_pixels
        raise MediaError(f"the image is over the limit of {limit} pixels ({error})") from None
    except UnidentifiedImageError:
        raise MediaError(
            f"the image is not a {', '.join(FORMATS)} file Pillow can read (its first bytes: {data[:8]!r})"
        ) from None
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise MediaError(
            f"the image is {width} x {height} pixels, over the limit of {policy.max_image_pixels}; "
            "send a smaller image"
        )
    try:
        image.seek(0)  # an animation's first frame
        image.load()
    except (OSError, ValueError, SyntaxError) as error:  # truncated or corrupt data
        raise MediaError(f"the {image.format} image cannot be decoded ({error})") from None
    return image


def _data_url_bytes(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise MediaError("a data: URL needs a comma before its data (data:image/png;base64,...)")
    media_type, *params = header.split(";")
    media_type = media_type.strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"the data: URL's content type is {media_type!r}, not an image (image/png, ...)")
    if len(payload) > policy.max_image_bytes * 4 // 3 + 4:
        raise MediaError(f"the data: URL holds more than {policy.max_image_bytes} bytes")
    if "base64" in (p.strip().lower() for p in params):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise MediaError(f"the data: URL's base64 does not decode ({error})") from None
    return unquote_to_bytes(payload)


def _local_file_bytes(url: str, policy: MediaPolicy) -> bytes:
    allowed = policy.allowed_local_media_path
    if allowed is None:
        raise MediaError("file:// image URLs are refused without --allowed-local-media-path DIR")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file:// URL names a file on this machine, not on {parts.netloc!r}")
    path = Path(unquote(parts.path)).resolve()
    root = allowed.resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"{path} is outside --allowed-local-media-path {root}")
    if not path.is_file():
        raise MediaError(f"{path}: no such file")
    size = path.stat().st_size
    if size > policy.max_image_bytes:
        raise MediaError(f"{path} is {size} bytes, over the limit of {policy.max_image_bytes}")
    return path.read_bytes()


def _fetched_bytes(url: str, policy: MediaPolicy) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if host not in policy.allowed_media_domains:
        raise MediaError(
            f"http(s) image URLs are fetched only from the hosts --allowed-media-domains names; {host!r} is "
            "not one (or send the image inline as a data: URL)"
        )
    import httpx

    try:
        with httpx.stream("GET", url, timeout=policy.fetch_timeout_s, follow_redirects=False) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching {_shown(url)} gave HTTP {response.status_code}")
            content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if not content_type.startswith("image/"):
                raise MediaError(f"{_shown(url)} is {content_type or 'of no content type'}, not an image")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > policy.max_image_bytes:
                    raise MediaError(f"{_shown(url)} is over the limit of {policy.max_image_bytes} bytes")
            return bytes(data)
    except httpx.HTTPError as error:
        raise MediaError(f"fetching {_shown(url)} failed: {type(error).__name__}: {error}") from None


def _shown(url: str) -> str:
    """The URL as an error message shows it: a data: URL's payload cut short."""
    return repr(url if len(url) <= 80 else url[:60] + "...")
