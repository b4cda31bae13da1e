"""Export to the layout vllm-project/speculators (>= 0.8) trains from (DESIGN.md §7).

results/export/speculators/
  data-*.arrow, dataset_info.json, state.json   datasets' save_to_disk, torch format: one row per `row`,
                                                 input_ids, loss_mask (int64 lists), seq_len (int64)
  token_freq.pt                                  torch.save'd {token_id: count} over loss-masked tokens
  hidden_states/hs_{row}.safetensors             token_ids [T] int64, hidden_states [T, L, H] model dtype
                                                 (hidden_states="copy" only)
  manifest.json                                  written last: sha256 of every file above, and the shard
                                                 folders (with their manifests' sha256) the rows come from

FP8 shards (extract.storage fp8_e4m3) export in speculators' FP8 format (hs_connectors.fp8_utils, read by
`speculators train --hidden-states-backend fp8`): hidden_states [T, L, H] float8_e4m3fn and
hidden_states_scales float32. Their own connector writes one scale per token over all layers, [T, 1, 1];
ours are the shards' own bytes and per-layer scales, [T, L, 1], which their backend's dequantization
(values * scales) broadcasts the same way. Requantizing to [T, 1, 1] would round a second time (DESIGN.md §7
says how much), and training from the copy would no longer equal training from the shards directly
(tests/test_train.py).

Rows with images export as any row: input_ids hold the target's vision tokens, the loss mask is 0 on
them, and the hidden states are those captured with the images. The images themselves stay out (speculators keeps
a multimodal row's `messages` only to ask a vLLM server for missing states, which this export never lacks); the
manifest counts `image_rows` and `images` when there are any.

speculators' ArrowDataset reads arrow row i together with hs_{i}.safetensors and uses
hidden_states[:, :-1] as the EAGLE-3 input and hidden_states[:, -1] as the verifier's last state
(before its final norm). Our global row ids are 0..n-1 in arrow order, so hs_{row} is hs_{i}; the
export checks that. Opt-in, because hidden_states="copy" copies every hidden-state byte;
hidden_states="direct" writes the small part only, and speculators' trainer reads the rows from the shard
folders through our hidden-states backend (eagle3prep.train.backend, `--hidden-states-backend eagle3prep`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from ..errors import UserError
from ..infra.atomic import TMP_PREFIX, atomic_open, fsync_dir, sha256_file
from ..infra.folder import file_entry, finish_folder, open_folder
from ..infra.log import get_logger
from ..infra.provenance import code_version
from ..layers import CONVENTION
from ..shard.formats import SCALES_KEY
from ..shard.layout import MANIFEST, TOKEN_IDS, layer_file
from ..shard.readers import LayerReader
from ..shard.shardset import Shard, ShardSet, ShardSetError
from ..shard.tokenized import rows as tokenized_rows

if TYPE_CHECKING:
    from ..settings import ExportSettings

log = get_logger("export")

FORMAT = "eagle3prep.speculators_export/1"
HIDDEN_STATES = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
MODES = ("copy", "direct")  # config export.hidden_states: copy the rows into hs files, or read the shards


class ExportError(UserError, ValueError):
    """The inputs cannot be exported as speculators training data; the message says why."""


def hs_file(row: int) -> str:
    """speculators' FileTransfer name for arrow row `row` (hs_connectors.transfer.FileTransfer.get_cached)."""
    return f"hs_{row}.safetensors"


def check_shards(shard_dirs: list[str], validations: list[str], tokenized: list[str]) -> ShardSet:
    """Validated shards that agree with their tokenized files and each other, rows 0..n-1 in order."""
    for d, v in zip(shard_dirs, validations, strict=True):
        report = json.loads(Path(v).read_text(encoding="utf-8"))
        if not report.get("ok") or Path(report["shard_dir"]).resolve() != Path(d).resolve():
            raise ExportError(f"{v} is not a passed validation of {d}; rerun validate_shard for it")
    try:
        return ShardSet.open(shard_dirs, tokenized).check(final_layer=True)
    except ShardSetError as e:
        raise ExportError(str(e)) from None


def _rows(shard: Shard) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(index entry, tokenized row) pairs of one shard (ShardSet checked they are the same rows)."""
    yield from zip(shard.index, tokenized_rows(shard.tokenized), strict=True)


def _write_hidden_states(out: Path, shard: Shard, layer_ids: list[int], files: dict[str, dict[str, Any]]) -> int:
    """Write hs_{row}.safetensors for every row of one shard; return its token count."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save

    tokens = 0
    as_stored = shard.manifest.storage_format.exports_scales  # values and scales kept; any other storage is decoded
    with contextlib.ExitStack() as stack:
        shard_dir, tokenized = shard.dir, shard.tokenized
        readers = [LayerReader(shard_dir / layer_file(i)) for i in layer_ids]  # each [sum_T, H], memory-mapped
        token_slice = stack.enter_context(safe_open(shard_dir / TOKEN_IDS, framework="pt")).get_slice(
            "token_ids"
        )  # [sum_T] int64
        for e, rec in _rows(shard):
            a, b = e.offset, e.offset + e.length
            token_ids = token_slice[a:b]  # [T] int64
            if token_ids.tolist() != rec["input_ids"]:
                raise ExportError(f"{shard_dir}: stored token ids of row {e.row} differ from {tokenized}")
            if as_stored:  # the shards' FP8 bytes [T, L, H] and their per-layer scales [T, L, 1], not rounded again
                values = torch.stack([r.values[a:b] for r in readers], dim=1)
                scales = torch.stack([r.scales[a:b] for r in readers], dim=1)
                blob = save({"token_ids": token_ids, "hidden_states": values, SCALES_KEY: scales})
            else:
                # [T, L, H], ascending layer ids; an MXFP4 shard decodes to bf16 exactly (speculators reads no 4-bit)
                hidden = torch.stack([r.rows(a, b) for r in readers], dim=1)
                blob = save({"token_ids": token_ids, "hidden_states": hidden})
            name = f"{HIDDEN_STATES}/{hs_file(e.row)}"
            with atomic_open(out / name, "wb") as f:
                f.write(blob)
            files[name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
            tokens += e.length
    return tokens


def _write_arrow(out: Path, shards: ShardSet, files: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The arrow dataset, built as a stream (memory does not grow with the data) and moved in file by file;
    returns the rows with images and their images ({} when there are none)."""
    from datasets import Dataset, Features, List, Value
    from datasets.arrow_reader import ArrowReader
    from datasets.arrow_writer import ArrowWriter

    features = Features(
        {"input_ids": List(Value("int64")), "loss_mask": List(Value("int64")), "seq_len": Value("int64")}
    )
    stream = out / f"{TMP_PREFIX}rows.arrow"
    staging = out / f"{TMP_PREFIX}arrow"
    image_rows = images = 0
    with ArrowWriter(features=features, path=str(stream)) as writer:
        for shard in shards.shards:
            for _, rec in _rows(shard):
                # An image row is its input_ids with the vision tokens in them (loss mask 0 there) and its
                # captured states, like any row: the trainer needs neither the pixels nor the grid.
                writer.write({k: rec[k] for k in ("input_ids", "loss_mask", "seq_len")})
                image_rows += "images" in rec
                images += len(rec.get("images", ()))
        writer.finalize()
    # Dataset.from_file would fingerprint the file's mtime; a content hash keeps reruns byte-identical.
    ds = Dataset(ArrowReader.read_table(str(stream)), fingerprint=sha256_file(stream)[:16])
    # speculators compares hs token_ids with dataset["input_ids"] via torch.equal: tensors, so torch format.
    ds.set_format(type="torch")
    ds.save_to_disk(str(staging))
    del ds
    for p in sorted(staging.iterdir()):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        os.replace(p, out / p.name)
        files[p.name] = file_entry(out / p.name)
    fsync_dir(out)
    staging.rmdir()
    stream.unlink()
    return {"image_rows": image_rows, "images": images} if image_rows else {}


def _write_token_freq(out: Path, token_freq_json: str, files: dict[str, dict[str, Any]]) -> None:
    """speculators' own format (train/vocab_mapping.py): torch.save of a dict {token_id: count}, int keys."""
    import torch

    counts = json.loads(Path(token_freq_json).read_text(encoding="utf-8"))
    with atomic_open(out / TOKEN_FREQ, "wb") as f:
        torch.save({int(t): int(c) for t, c in counts.items()}, f)
    files[TOKEN_FREQ] = file_entry(out / TOKEN_FREQ)


def _storage_fields(first) -> dict[str, Any]:
    """What the hs files hold, for scaled shards, and the speculators backend that reads them (named for the model's
    dtype too, so the manifest says how to train from it): the shards' format says both."""
    fmt = first.storage_format
    backend = {"hidden_states_backend": fmt.speculators_backend}  # speculators train --hidden-states-backend
    return {"storage": fmt.export_entry, **backend} if fmt.export_entry else backend


# What an earlier or killed export left in its folder, removed by name (infra.folder.open_folder: the folder may
# hold other files). d2t-/t2d-{size}.npy: vocab mappings speculators' trainer caches beside token_freq.pt.
OUTPUTS = (HIDDEN_STATES, "data-*.arrow", "dataset_info.json", "state.json", TOKEN_FREQ, "d2t-*.npy", "t2d-*.npy")


def _sources(shards: ShardSet) -> list[dict[str, Any]]:
    """Each shard folder as the export's rows depend on it (as given: the manifest does not depend on where
    the export is written), `row_range` maps a row to its shard, the manifest's sha256 pins its contents."""
    return [
        {
            "shard_dir": str(s.dir),
            "row_range": s.manifest.row_range,
            "manifest_sha256": sha256_file(s.dir / MANIFEST),
        }
        for s in shards.shards
    ]


def _copy_hidden_states(out: Path, shards: ShardSet, files: dict[str, dict[str, Any]]) -> int:
    """hs_{row}.safetensors for every row of every shard (hidden_states="copy"); returns the token count."""
    from tqdm import tqdm

    (out / HIDDEN_STATES).mkdir()
    tokens = 0
    bar = tqdm(total=sum(s.manifest.rows for s in shards.shards), unit="row", file=sys.stderr, mininterval=1.0,
               desc="hs files")  # fmt: skip
    for shard in shards.shards:
        tokens += _write_hidden_states(out, shard, shards.layer_ids, files)
        bar.update(shard.manifest.rows)
    bar.close()
    fsync_dir(out / HIDDEN_STATES)
    return tokens


@dataclass(frozen=True, slots=True)
class ExportPaths:
    """The export job's files: every shard, its validation and tokenized rows (in row order), the folder out."""

    shard_dirs: Sequence[str]
    validations: Sequence[str]
    tokenized: Sequence[str]
    token_freq_json: str  # results/tokenized/token_freq.json
    out_dir: str  # results/export/speculators


@dataclass(frozen=True, slots=True)
class ExportJobSettings:
    """What the export job reads: `export:` (params.hidden_states, the rerun trigger, holds the same value)."""

    export: ExportSettings

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        from ..settings import ExportSettings

        return cls(ExportSettings.from_config(config))


def run_export_job(paths: ExportPaths, settings: ExportJobSettings) -> dict[str, Any]:
    """The export stage's job: the validated shards written to `out_dir` as `settings` say."""
    p = paths
    return export_speculators(list(p.shard_dirs), list(p.validations), list(p.tokenized), p.token_freq_json,
                              p.out_dir, settings.export.hidden_states)  # fmt: skip


def export_speculators(
    shard_dirs: list[str],
    validations: list[str],
    tokenized: list[str],
    token_freq_json: str,
    out_dir: str,
    hidden_states: str,
) -> dict[str, Any]:
    """Write `out_dir` in speculators' layout; manifest.json last. Shards must come in row order.

    hidden_states="direct" writes no hs files: the trainer reads every row from the shard folders."""
    if hidden_states not in MODES:
        raise ExportError(f"export.hidden_states = {hidden_states!r}; choose one of {list(MODES)}")
    shards = check_shards(shard_dirs, validations, tokenized)
    first = shards.first
    layer_ids = first.layer_ids
    out = Path(out_dir)
    open_folder(out, OUTPUTS)

    rows = sum(s.manifest.rows for s in shards.shards)
    log.info(
        f"{rows} rows from {len(shard_dirs)} shards, layers {layer_ids} ({CONVENTION}), "
        f"hidden states: {hidden_states} -> {out}"
    )
    files: dict[str, dict[str, Any]] = {}
    image_counts = _write_arrow(out, shards, files)
    _write_token_freq(out, token_freq_json, files)
    if hidden_states == "copy":
        tokens = _copy_hidden_states(out, shards, files)
    else:
        tokens = sum(s.manifest.tokens for s in shards.shards)

    manifest = {
        "format": FORMAT,
        "hidden_states": hidden_states,
        "rows": rows,
        "tokens": tokens,
        # Only with image rows: a text-only export keeps its manifest's bytes.
        **image_counts,
        "layer_ids": layer_ids,
        "layer_id_convention": CONVENTION,
        # speculators train --target-layer-ids: the auxiliary ids, vLLM's convention (= ours), final slot excluded.
        "target_layer_ids": layer_ids[:-1],
        "num_hidden_layers": first.num_hidden_layers,
        "hidden_size": first.hidden_size,
        "dtype": first.dtype,
        "model": first.model,
        "tokenizer": first.tokenizer,
        # The hs files' layout and the backend that reads them; a direct export has no hs file.
        **(_storage_fields(first) if hidden_states == "copy" else {"hidden_states_backend": "eagle3prep"}),
        "sources": _sources(shards),
        "files": dict(sorted(files.items())),
        "code_version": code_version(),
    }
    finish_folder(out, manifest)
    _log_done(manifest)
    return manifest


def _log_done(manifest: dict[str, Any]) -> None:
    """The log's last line: rows (with images, when there are any), tokens, and the bytes written."""
    files = manifest["files"]
    size = sum(f["bytes"] for f in files.values())
    with_images = f" ({manifest['image_rows']} with {manifest['images']} images)" if "image_rows" in manifest else ""
    log.info(
        f"done: {manifest['rows']} rows{with_images}, {manifest['tokens']} tokens, {size / 2**20:.1f} MiB "
        f"in {len(files)} files"
    )
