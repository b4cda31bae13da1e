"""The extract stage: one tokenized shard in, one hidden-state shard folder out (DESIGN.md §4)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import faults
from .atomic import remove_stale_temps, sha256_file, write_json
from .backends import make_backend
from .backends.base import CaptureBackend, CaptureSpec
from .layers import CONVENTION
from .provenance import code_version, model_identity, tokenizer_identity
from .records import IndexEntry
from .shard import DTYPES, MANIFEST, TIMINGS, DiskSpaceError, ShardWriter, human_bytes, layer_file

if TYPE_CHECKING:
    import torch

# Probe facts that differ between two runs of the same shard (timings, which GPUs, temp paths): they
# go to timings.json, so equal data gives a byte-identical manifest.
VOLATILE = ("probe_s", "engine_init_s", "smoke_s", "gpu_ids", "staging_dir")


def read_index(tokenized_shard: str | os.PathLike) -> list[IndexEntry]:
    """First pass over a tokenized shard: where each row will sit in the layer files."""
    index, offset = [], 0
    with open(tokenized_shard, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            index.append(IndexEntry(row=rec["row"], id=rec["id"], offset=offset, length=rec["seq_len"]))
            offset += rec["seq_len"]
    return index


def iter_batches(tokenized_shard: str | os.PathLike, batch_tokens: int) -> Iterator[list[list[int]]]:
    """Second pass: contiguous rows, padded size (rows x longest) within `batch_tokens` (one row at least)."""
    batch: list[list[int]] = []
    longest = 0
    with open(tokenized_shard, encoding="utf-8") as f:
        for line in f:
            ids = json.loads(line)["input_ids"]
            if batch and (len(batch) + 1) * max(longest, len(ids)) > batch_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(ids)
            longest = max(longest, len(ids))
    if batch:
        yield batch


def shard_bytes(tokens: int, rows: int, num_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes a shard will take: layer files + token ids + index/manifest (a generous 200 B per row)."""
    return tokens * (num_layers * hidden_size * DTYPES[dtype][1] + 8) + 200 * rows + 65536


def model_hidden_size(model_path: str | os.PathLike) -> int | None:
    """H from the model's config.json (text config for multimodal wrappers); None when it has none."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    return int(text["hidden_size"]) if "hidden_size" in text else None


def free_space_probe(path: Path) -> Path:
    """`path`, or its nearest existing parent: where the filesystem that will hold `path` can be asked."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_space(out_dir: Path, needed: int) -> None:
    """Refuse a shard that cannot fit, before any of its files (or the engine) is created."""
    probe = free_space_probe(Path(out_dir))
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise DiskSpaceError(
            f"not enough disk for {out_dir}: the shard needs {human_bytes(needed)} ({needed} bytes), "
            f"{probe} has {human_bytes(free)} ({free} bytes) free; free space or point results/ at a larger "
            "filesystem (`snakemake plan` lists every shard's size)"
        )


def _token_ids(batch: list[list[int]]) -> torch.Tensor:
    import torch

    return torch.tensor([t for row in batch for t in row], dtype=torch.int64)  # [sum_T_batch]


def capture_batches(
    backend: CaptureBackend, tokenized_shard: str, writer: ShardWriter, batch_tokens: int, shard: int, bar: Any
) -> None:
    """Batch by batch through backend.capture(); this process writes every file.

    One writer thread: batch i goes to disk while batch i+1 is captured (file writes and sha256
    release the GIL). Waiting for write i before handing over i+1 keeps at most two batches in host
    memory, and the single thread keeps the rows in order.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as io:
        pending = None
        for b, batch in enumerate(iter_batches(tokenized_shard, batch_tokens)):
            hidden = backend.capture(batch)  # {layer_id: [sum_T_batch, H]}
            token_ids = _token_ids(batch)
            if pending is not None:
                pending.result()  # batch b-1 is written (its error, e.g. a full disk, raises here)
            pending = io.submit(writer.append, token_ids, hidden)
            del hidden
            bar.update(int(token_ids.shape[0]))
            faults.kill_point("extract.between_batches", shard=shard, batch=b)
        if pending is not None:
            pending.result()


def capture_direct(
    backend: CaptureBackend,
    tokenized_shard: str,
    index: list[IndexEntry],
    writer: ShardWriter,
    batch_tokens: int,
    shard: int,
    bar: Any,
) -> None:
    """The whole shard through backend.capture_shard(): the engine writes the layer files' temp
    files itself (vLLM hooks path: pinned host slots, writer threads, rows placed by position)."""

    def on_batch(b: int, batch: list[list[int]]) -> None:
        token_ids = _token_ids(batch)
        writer.append_tokens(token_ids)
        bar.update(int(token_ids.shape[0]))  # submitted to the engine (at most a window ahead of the GPU)
        faults.kill_point("extract.between_batches", shard=shard, batch=b)

    entries = backend.capture_shard(iter_batches(tokenized_shard, batch_tokens), index, writer.layer_paths(), on_batch)
    writer.adopt_layers(entries)


def extract_shard(
    tokenized_shard: str,
    out_dir: str,
    spec: CaptureSpec,
    options: dict[str, Any],
    batch_tokens: int,
    shard: int,
    threads: int | None = None,
    engine: tuple[CaptureBackend, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Capture one shard; the folder gets its manifest only after every file is in place.

    `engine` = (backend, probe info) of an engine that is already running (benchmarks reuse one
    across shards); it is left open. By default the shard starts and closes its own.
    """
    import torch
    from tqdm import tqdm

    if threads:  # the job's Snakemake `threads`; also keeps CPU results independent of the host's core count
        torch.set_num_threads(threads)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    (out / MANIFEST).unlink(missing_ok=True)  # a stale manifest must never describe new files
    t0 = time.time()
    index = read_index(tokenized_shard)
    tokens = sum(e.length for e in index)
    hidden_size = model_hidden_size(spec.model_path)
    if hidden_size is not None:  # refuse before the engine starts: seconds, not an engine start-up
        check_free_space(out, shard_bytes(tokens, len(index), len(spec.layer_ids), hidden_size, spec.dtype))

    version = code_version()  # the code this shard starts with, before hours of capture
    faults.kill_point("extract.model_load", shard=shard)
    if engine is None:
        spec.extra["output_dir"] = str(out)  # vLLM's built-in path stages per-request files here (same filesystem)
        backend = make_backend(spec, options)
        info = backend.probe()
        close = backend.close
    else:
        (backend, info), close = engine, (lambda: None)
    t_loaded = time.time()
    needed = shard_bytes(tokens, len(index), len(spec.layer_ids), info["hidden_size"], spec.dtype)
    print(
        f"[extract] shard {shard}: {len(index)} rows, {tokens} tokens, layers {spec.layer_ids}, "
        f"{info['engine']} {info['engine_version']} via {info['capture_path']}, ~{needed / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    try:  # again with the engine's own H and the space other jobs took meanwhile; still before any layer file
        check_free_space(out, needed)
        direct = backend.writes_layer_files()
        writer = ShardWriter(out, spec.layer_ids, info["hidden_size"], spec.dtype, index, layers_elsewhere=direct)
    except BaseException:
        close()
        raise
    bar = tqdm(total=tokens, unit="tok", unit_scale=True, file=sys.stderr, mininterval=1.0, desc=f"shard {shard}")
    try:
        if direct:  # the engine's worker writes the layer files; here: token ids, index, manifest
            capture_direct(backend, tokenized_shard, index, writer, batch_tokens, shard, bar)
        else:
            capture_batches(backend, tokenized_shard, writer, batch_tokens, shard, bar)
        bar.close()
        t_done = time.time()

        def before_manifest() -> None:
            elapsed = t_done - t_loaded
            write_json(
                out / TIMINGS,
                {
                    "engine_start_s": round(t_loaded - t0, 3),
                    "capture_s": round(elapsed, 3),
                    "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
                    **{k: info[k] for k in VOLATILE if k in info},
                    **({"writer": backend.capture_stats} if direct else {}),
                },
            )
            faults.kill_point("extract.before_manifest", shard=shard)

        manifest = writer.finish(
            {
                "shard": shard,
                "layer_id_convention": CONVENTION,
                "num_hidden_layers": info["num_hidden_layers"],
                "hidden_size": info["hidden_size"],
                "dtype": spec.dtype,
                "row_range": [index[0].row, index[-1].row + 1] if index else [0, 0],
                "tokenized": {"path": str(tokenized_shard), "sha256": sha256_file(tokenized_shard)},
                "model": model_identity(spec.model_path, spec.trust_remote_code),
                "tokenizer": tokenizer_identity(spec.model_path),
                "engine": {
                    k: info[k] for k in sorted(info) if k not in ("num_hidden_layers", "hidden_size", *VOLATILE)
                },
                "code_version": version,
            },
            before_manifest=before_manifest,
        )
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()  # on a failure too: the log shows how far the shard got
        close()
    elapsed = t_done - t_loaded
    print(
        f"[extract] shard {shard}: done, {tokens / max(elapsed, 1e-9):.0f} tok/s, "
        f"{sum(f['bytes'] for f in manifest['files'].values()) / 2**20:.1f} MiB in "
        f"{', '.join(layer_file(i) for i in spec.layer_ids)}",
        file=sys.stderr,
    )
    return manifest
