"""Identity of the model, tokenizer and code, recorded in every manifest."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from .. import __version__
from .atomic import sha256_file


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _weights_identity(folder: Path) -> str:
    """sha256 of the weight index (sharded checkpoints) or of the single file's safetensors header.

    Hashing headers, not the weights, keeps this cheap for a 1 TB checkpoint while still changing
    whenever tensor names, shapes or dtypes change; the config hash covers the rest.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sha256_file(index)
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + fh.read(n))
    return h.hexdigest()


def model_identity(model_path: str, trust_remote_code: bool) -> dict[str, Any]:
    folder = Path(model_path)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return {
        "path": str(model_path),
        "architectures": config.get("architectures"),
        "config_sha256": sha256_file(folder / "config.json"),
        "weights_sha256": _weights_identity(folder),
        "trust_remote_code": trust_remote_code,
    }


def tokenizer_identity(model_path: str) -> dict[str, Any]:
    """Hashes of tokenizer.json and of the chat template (its own file or the tokenizer_config key)."""
    folder = Path(model_path)
    out: dict[str, Any] = {}
    if (folder / "tokenizer.json").is_file():
        out["tokenizer_sha256"] = sha256_file(folder / "tokenizer.json")
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "tokenizer_config.json").is_file():
        template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    out["chat_template_sha256"] = _sha256_text(json.dumps(template)) if template is not None else None
    return out


@functools.cache
def code_version() -> str:
    """Package version plus a sha256 of the package's source files, the code that actually ran.

    Not the git commit: a checkout with uncommitted edits would claim a commit it does not run, and
    a commit that only touches docs would change every manifest of otherwise identical data. Cached:
    extract_shard calls it before the engine starts, so a shard names the code it was started with.
    """
    here = Path(__file__).resolve().parents[1]  # the package, not infra/
    digest = hashlib.sha256()
    sources = (p for p in here.rglob("*.py") if p.is_file() and not p.name.startswith("."))  # no editor lock links
    for path in sorted(sources):
        digest.update(path.relative_to(here).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"eagle3prep {__version__} (src sha256 {digest.hexdigest()[:12]})"
