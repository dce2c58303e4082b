"""Loading a request's image: data: URLs in each format, local files only under the allowed folder,
http(s) only from allowed hosts (a real server on 127.0.0.1), and a MediaError for everything else."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kiln.runtime.media import MediaError, MediaPolicy, decode_image, load_image

POLICY = MediaPolicy()


def _picture(width: int = 24, height: int = 16) -> Image.Image:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _encoded(image: Image.Image, image_format: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_from_a_data_url(image_format: str) -> None:
    picture = _picture()
    image = load_image(_data_url(_encoded(picture, image_format), f"image/{image_format.lower()}"), POLICY)
    assert image.size == picture.size and image.format == image_format
    if image_format == "PNG":
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(picture))


def test_an_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    image = load_image(_data_url(buffer.getvalue(), "image/gif"), POLICY)
    assert image.convert("RGB").getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:image/png;base64,@@@", "base64"),
        ("data:image/png;base64", "comma"),
        (_data_url(b"GIF89a but not really a gif at all"), "cannot be decoded|not a PNG"),
        (_data_url(b"\x00\x01\x02 random bytes"), "not a PNG"),
        (_data_url(_encoded(_picture(), "BMP"), "image/bmp"), "not a PNG"),  # Pillow reads BMP; not allowed
        ("ftp://example.com/a.png", "data: URL"),
        ("just-a-name.png", "data: URL"),
    ],
)
def test_a_bad_image_is_a_media_error(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        load_image(url, POLICY)


def test_a_truncated_image_is_a_media_error() -> None:
    data = _encoded(_picture(64, 64), "PNG")
    with pytest.raises(MediaError, match="cannot be decoded"):
        decode_image(data[: len(data) // 2], POLICY)


def test_a_decompression_bomb_is_refused_before_decoding() -> None:
    data = bytearray(_encoded(Image.new("L", (1, 1)), "PNG"))
    header = struct.pack(">II", 50_000, 50_000) + bytes(data[24:29])  # IHDR: width, height, the rest
    data[16:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    with pytest.raises(MediaError, match=r"over the limit of 16777216 pixels \(Image size \(2500000000"):
        decode_image(bytes(data), POLICY)
    with pytest.raises(MediaError, match="over the limit of 100"):
        decode_image(_encoded(_picture(20, 20), "PNG"), MediaPolicy(max_image_pixels=100))
    with pytest.raises(MediaError, match="bytes, over the limit"):
        decode_image(_encoded(_picture(20, 20), "PNG"), MediaPolicy(max_image_bytes=100))


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    allowed = tmp_path / "images"
    allowed.mkdir()
    inside = allowed / "a picture.png"
    inside.write_bytes(_encoded(_picture(), "PNG"))
    outside = tmp_path / "secret.png"
    outside.write_bytes(_encoded(_picture(), "PNG"))
    (allowed / "link.png").symlink_to(outside)
    url = inside.as_uri()
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_image(url, POLICY)
    policy = MediaPolicy(allowed_local_media_path=allowed)
    assert load_image(url, policy).size == (24, 16)
    for escaping in (f"file://{allowed}/../secret.png", (allowed / "link.png").as_uri()):
        with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
            load_image(escaping, policy)
    with pytest.raises(MediaError, match="no such file"):
        load_image((allowed / "missing.png").as_uri(), policy)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1: /a.png an image, /text.txt text, anything else a 404."""
    png = _encoded(_picture(), "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, content_type = {"/a.png": (png, "image/png"), "/text.txt": (b"hello", "text/plain")}.get(
                self.path, (b"", "")
            )
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", content_type or "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_urls_only_from_allowed_hosts(image_server: str) -> None:
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        load_image(f"{image_server}/a.png", POLICY)
    with pytest.raises(MediaError, match=r"'example\.com' is not one"):
        load_image("https://example.com/a.png", MediaPolicy(allowed_media_domains=frozenset({"127.0.0.1"})))
    policy = MediaPolicy(allowed_media_domains=frozenset({"127.0.0.1"}))
    assert load_image(f"{image_server}/a.png", policy).size == (24, 16)
    with pytest.raises(MediaError, match="text/plain, not an image"):
        load_image(f"{image_server}/text.txt", policy)
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{image_server}/missing.png", policy)
