"""Images in conversations: an image reference -> a normalized image part, or Rejected.

A reference is a `data:` URI, a local path or a `file://` URL (relative ones resolved against
data.image_root), or raw bytes (a Hugging Face Image feature's {"bytes", "path"}). Each image is read
with Pillow here, once, so that a missing, truncated or oversized image is quarantined in prepare with
its own reason instead of failing a later stage; it is identified by the sha256 of its bytes.

A normalized image part is `{"type": "image", "image": <path or data: URI>, "sha256", "width", "height"}`:
the shape transformers' processors and chat templates take (`"image"` is what they load), plus what
later stages check the pixels against. There is no network in prepare: an http(s) URL is quarantined.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import urllib.parse
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3prep.prepare.errors import InputError, Rejected

if TYPE_CHECKING:
    from eagle3prep.settings import DataSettings

# What the OpenAI API accepts (PNG, JPEG, WEBP, non-animated GIF): the formats servers and processors agree on.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
IMAGE_MARKER = "<image>"  # LLaVA / ShareGPT: where each image of the record's `image` / `images` field goes
CACHE_ENTRIES = 4096  # image files whose decoded facts prepare keeps, for records that share an image
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(slots=True)
class ImageOptions:
    """How prepare reads images: data.image_root (None = the working directory, as data.sources) and the
    pixel budget. `cache`: an image file named by many records is decoded once per run."""

    root: str | None
    max_pixels: int
    cache: dict[tuple, dict[str, Any]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, settings: DataSettings) -> ImageOptions:
        """From data.image_root and data.max_image_pixels."""
        return cls(settings.image_root, settings.max_image_pixels)

    def __post_init__(self):
        """A data.image_root that is not a folder stops prepare in one line: every image under it would be missing."""
        if self.root is not None and not os.path.isdir(self.root):
            raise InputError(f"data.image_root: '{self.root}' is not a folder (cwd: {os.getcwd()})")

    def read(self, ref: Any, where: str) -> dict[str, Any]:
        """The normalized image part for one reference, or Rejected with an image_* reason."""
        if isinstance(ref, dict) and isinstance(ref.get("bytes"), bytes | bytearray):  # HF Image feature
            return self._decode(bytes(ref["bytes"]), None, where, ref.get("path") or "bytes")
        if isinstance(ref, dict) and isinstance(ref.get("path"), str):
            ref = ref["path"]
        if not isinstance(ref, str) or not ref.strip():
            raise Rejected("image_unreadable", f"{where} is a {type(ref).__name__}, expected a path, URL or data: URI")
        if ref.startswith("data:"):
            return self._decode(data_uri_bytes(ref, where), ref, where, "data: URI")
        scheme = _SCHEME.match(ref)
        if scheme and len(scheme.group(1)) > 1 and scheme.group(1).lower() != "file":  # "C:" is a drive
            raise Rejected(
                "image_remote_url",
                f"{where} is a remote URL ({_short(ref)}); prepare has no network: download the images and "
                "name them by path (relative paths are read under data.image_root)",
            )
        path = self._resolve(ref, where)
        try:
            st = os.stat(path)
        except OSError as e:
            raise Rejected(
                "image_missing", f"{where}: {path} cannot be read ({e.strerror}){self._root_hint()}"
            ) from None
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in self.cache:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise Rejected("image_missing", f"{where}: {path} cannot be read ({e.strerror})") from None
            if len(self.cache) >= CACHE_ENTRIES:  # bounded: a dataset of distinct images gains nothing from it
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = self._decode(data, path, where, path)
        return dict(self.cache[key])

    def _resolve(self, ref: str, where: str) -> str:
        """A local path or file:// URL as a path: relative ones joined to data.image_root (absolute stay)."""
        if ref.lower().startswith("file:"):
            parsed = urllib.parse.urlparse(ref)
            if parsed.netloc not in ("", "localhost"):
                raise Rejected(
                    "image_remote_url",
                    f"{where} is a file URL on host {parsed.netloc!r} ({_short(ref)}); prepare reads local files only",
                )
            ref = urllib.parse.unquote(parsed.path)
        return os.path.join(self.root, ref) if self.root else ref

    def _root_hint(self) -> str:
        return (
            f" (data.image_root: {self.root})"
            if self.root
            else " (data.image_root is not set: relative to the working directory)"
        )

    def _decode(self, data: bytes, location: str | None, where: str, what: str) -> dict[str, Any]:
        """Decode `data` fully with Pillow (a truncated file fails only when its pixels are read) and check the
        format and the pixel budget; the part names `location`, or a data: URI of the bytes when None."""
        from PIL import Image, UnidentifiedImageError

        if data.lstrip()[:5] in (b"<svg ", b"<?xml") or data.lstrip()[:4] == b"<svg":
            raise Rejected(
                "image_unsupported_format", f"{where}: {_short(what)} is SVG (vector); rasterize it to PNG first"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the budget below is the check
            try:
                img = Image.open(io.BytesIO(data))
            except Image.DecompressionBombError as e:
                raise Rejected("image_too_large", f"{where}: {_short(what)}: {_one_line(e)}") from None
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
                raise Rejected(
                    "image_unreadable", f"{where}: {_short(what)} is not an image Pillow can read ({_one_line(e)})"
                ) from None
            fmt, (width, height) = img.format, img.size
            if fmt not in FORMATS:
                raise Rejected(
                    "image_unsupported_format",
                    f"{where}: {_short(what)} is {fmt}; supported: {', '.join(FORMATS)} (convert it to PNG)",
                )
            if getattr(img, "n_frames", 1) > 1:
                raise Rejected(
                    "image_unsupported_format",
                    f"{where}: {_short(what)} is an animated {fmt} of {img.n_frames} frames",
                )
            if width * height > self.max_pixels:  # checked on the header, before the pixels are decoded
                raise Rejected(
                    "image_too_large",
                    f"{where}: {_short(what)} is {width}x{height} = {width * height} pixels, over "
                    f"data.max_image_pixels = {self.max_pixels}",
                )
            try:
                img.load()
            except (OSError, SyntaxError, ValueError, EOFError) as e:  # "image file is truncated", bad CRC, ...
                raise Rejected(
                    "image_unreadable", f"{where}: {_short(what)} is truncated or corrupt ({_one_line(e)})"
                ) from None
        if location is None:
            location = f"data:{FORMATS[fmt]};base64,{base64.b64encode(data).decode('ascii')}"
        return {
            "type": "image",
            "image": location,
            "sha256": hashlib.sha256(data).hexdigest(),
            "width": width,
            "height": height,
        }


def data_uri_bytes(uri: str, where: str) -> bytes:
    """The bytes of a `data:[<mediatype>][;base64],<data>` URI; the media type must be an image's."""
    head, comma, payload = uri.partition(",")
    if not comma:
        raise Rejected("image_unreadable", f"{where}: data: URI has no ',' before its data")
    params = head[len("data:") :].split(";")
    mediatype = params[0].strip().lower() or "text/plain"
    if not mediatype.startswith("image/"):
        raise Rejected("image_unsupported_format", f"{where}: data: URI is {mediatype!r}, not an image")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise Rejected("image_unreadable", f"{where}: data: URI is not valid base64") from None


def image_key(part: dict[str, Any]) -> dict[str, Any]:
    """What a conversation's id hashes of an image part: its bytes' sha256, not where it was read from."""
    return {"type": "image", "sha256": part["sha256"]}


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
