"""The extract stage: one tokenized shard in, one hidden-state shard folder out (DESIGN.md §4).

run_extract_job(paths, settings) is what the extract rule runs: it makes the job's one CaptureSpec (the typed
ExtractSettings of settings.py, the model and its config.json facts, its layer ids, and the storage format they name,
resolved there once). extract_shard is the same with a CaptureSpec already made, and optionally an engine already
running (benchmarks reuse one across shards); the model's config.json is read once per job, and the spec carries it
to the backend.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ..backends.base import CaptureBackend, CaptureSpec, EngineInfo
from ..infra import faults
from ..infra.atomic import sha256_file
from ..infra.disk import DiskSpaceError
from ..infra.folder import open_folder
from ..infra.gpus import claim_job_gpus
from ..infra.log import get_logger
from ..infra.provenance import code_version, model_identity, tokenizer_identity
from ..infra.units import human_bytes
from ..layers import CONVENTION, check_layer_ids
from ..model_facts import ModelFacts, require_hidden_size
from ..settings import ExtractSettings, LayersSettings
from ..shard.formats import StorageFormat
from ..shard.layout import MANIFEST, layer_file
from ..shard.manifest import ShardManifest
from ..shard.readers import index_of_tokenized
from ..shard.tokenized import rows as tokenized_rows
from ..shard.writer import ShardWriter
from ..tokenize.row_inputs import ImageRow
from ..vllm.engine.errors import EngineError
from .backend import empty_backend, make_backend

log = get_logger("extract")


def iter_batches(tokenized_shard: str | os.PathLike, batch_tokens: int) -> Iterator[list[list[int]]]:
    """Second pass: contiguous rows, padded size (rows x longest) within `batch_tokens` (one row at least)."""
    batch: list[list[int]] = []
    longest = 0
    for rec in tokenized_rows(tokenized_shard):
        ids = ImageRow(rec, tokenized_shard) if "images" in rec else rec["input_ids"]  # pixels on the backend
        if batch and (len(batch) + 1) * max(longest, len(ids)) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(ids)
        longest = max(longest, len(ids))
    if batch:
        yield batch


def shard_bytes(
    tokens: int,
    rows: int,
    num_layers: int,
    hidden_size: int,
    dtype: str,
    storage: StorageFormat,
) -> int:
    """Bytes a shard will take: layer files (values and any scales, shard/formats.py) + token ids +
    index/manifest (a generous 200 B per row)."""
    return tokens * (num_layers * storage.token_bytes(hidden_size, dtype) + 8) + 200 * rows + 65536


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


@dataclass(frozen=True, slots=True)
class ExtractPaths:
    """The extract job's files, what differs between its jobs: shard `shard`'s rows in, its folder out."""

    tokenized_shard: str  # results/tokenized/shard_{k}.jsonl
    out_dir: str  # results/hidden_states/shard_{k}
    model_path: str
    shard: int  # k


@dataclass(frozen=True, slots=True)
class ExtractJobSettings:
    """What every extract job of a run reads: the config's `extract:` and `layers:` and what Snakemake grants."""

    extract: ExtractSettings
    layers: LayersSettings
    max_seq_len: int  # tokenize.max_seq_len: the longest row a shard can hold
    trust_remote_code: bool
    threads: int | None  # the job's Snakemake threads; None leaves torch's own

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, threads: int | None) -> Self:
        """From the config as it is now (its `extract:` params are only the rerun trigger, settings.py says why)."""
        return cls(
            ExtractSettings.from_config(config), LayersSettings.from_config(config),
            config["tokenize"]["max_seq_len"], config["model"]["trust_remote_code"], threads,
        )  # fmt: skip


def run_extract_job(paths: ExtractPaths, settings: ExtractJobSettings) -> ShardManifest:
    """The extract rule's job: layer ids resolved against the model, then extract_shard."""
    facts = ModelFacts.read(paths.model_path)
    spec = CaptureSpec(
        settings.extract,
        model_path=paths.model_path,
        layer_ids=settings.layers.capture_ids(facts.num_hidden_layers),
        max_seq_len=settings.max_seq_len,
        trust_remote_code=settings.trust_remote_code,
        facts=facts,
    )
    return extract_shard(paths.tokenized_shard, paths.out_dir, spec, paths.shard, settings.threads)


def extract_shard(
    tokenized_shard: str,
    out_dir: str,
    spec: CaptureSpec,
    shard: int,
    threads: int | None = None,
    engine: tuple[CaptureBackend, EngineInfo] | None = None,
) -> ShardManifest:
    """Capture one shard: refuse early (layer ids, disk), claim GPUs, start the engine, stream the
    rows. `engine` = (backend, probe info) already running: left open, no GPUs claimed here. A shard
    without rows starts no engine."""
    import torch

    if threads:  # the job's Snakemake `threads`; also keeps CPU results independent of the host's core count
        torch.set_num_threads(threads)
    spec = spec.with_facts()  # config.json read once, here or by the caller
    check_layer_ids(spec.layer_ids, spec.facts.num_hidden_layers)
    out = open_folder(out_dir)  # an earlier run's manifest and temp files removed
    try:
        return _extract_into(out, tokenized_shard, spec, shard, engine)
    except KeyboardInterrupt:
        # Ctrl-C: a folder without a manifest is no shard, and an empty shard_k/ left behind read like one.
        # Any other failure keeps its files for study (Snakemake removes a failed job's output itself).
        if not (out / MANIFEST).exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _extract_into(out, tokenized_shard, spec, shard, engine) -> ShardManifest:
    index = index_of_tokenized(tokenized_shard, spec.backend)
    tokens = sum(e.length for e in index)
    hidden = require_hidden_size(spec.facts, spec.model_path)
    needed = shard_bytes(tokens, len(index), len(spec.layer_ids), hidden, spec.dtype, spec.storage)
    check_free_space(out, needed)  # seconds, not an engine start-up
    version = code_version()  # the code this shard starts with, before hours of capture
    t0 = time.time()
    faults.kill_point("extract.model_load", shard=shard)
    claim_record = None
    with contextlib.ExitStack() as stack:
        if engine is None and not index:  # more shards than rows: files of shape [0, H], no engine, no GPU
            backend = empty_backend(spec)
            info = backend.probe()
        elif engine is None:
            claim = stack.enter_context(claim_job_gpus(spec.gpus()))  # before the engine reads CUDA_VISIBLE_DEVICES
            claim_record = claim.record()
            shutil.rmtree(out / ".vllm-staging", ignore_errors=True)  # an older layout's, left by a killed run
            backend = stack.enter_context(make_backend(spec))
            info = backend.probe()
        else:
            backend, info = engine
        log.info(
            f"shard {shard}: {len(index)} rows, {tokens} tokens, layers {spec.layer_ids}, "
            f"{info.engine} {info.engine_version} via {info.capture_path}, {spec.storage.name} storage, ~{needed / 2**20:.1f} MiB"
        )
        check_free_space(out, needed)  # again: other jobs may have taken space meanwhile
        job = _Job(out, spec, info, index, tokenized_shard, shard, version, t0, claim_record)
        return job.write(backend)


class _Job:
    """One shard's stream through a probed backend: token ids, layer files, index, manifest."""

    def __init__(self, out, spec, info, index, tokenized_shard, shard, version, t0, claim=None):  # noqa: PLR0913
        self.out, self.spec, self.info, self.index, self.settings = out, spec, info, index, spec.settings
        self.tokenized, self.shard, self.version, self.t0 = tokenized_shard, shard, version, t0
        self.claim = claim  # GpuClaim.record() of this job's claim; None when the engine came from the caller

    def write(self, backend: CaptureBackend) -> ShardManifest:
        from tqdm import tqdm

        tokens = sum(e.length for e in self.index)
        writer = ShardWriter(
            self.out,
            self.spec.layer_ids,
            self.info.hidden_size,
            self.spec.dtype,
            self.index,
            storage=self.spec.storage,
        )
        bar = tqdm(
            total=tokens, unit="tok", unit_scale=True, file=sys.stderr, mininterval=1.0, desc=f"shard {self.shard}"
        )

        def on_batch(b: int, batch: list[list[int]]) -> None:
            bar.update(sum(len(r) for r in batch))  # submitted to the engine (at most a window ahead of the GPU)
            faults.kill_point("extract.between_batches", shard=self.shard, batch=b)

        t_loaded = time.time()
        try:
            batches = writer.tee(iter_batches(self.tokenized, self.settings.speed.batch_tokens), on_batch)
            spec = writer.sink_spec(backend.sink_plan(), logprob_rows=self._logprob_rows())
            entries = backend.capture_shard(batches, spec)
            bar.close()
            elapsed = time.time() - t_loaded

            manifest = writer.finish(
                entries,
                self._manifest_fields(),
                timings=self._timings(backend, tokens, t_loaded, elapsed),
                kill_point=("extract.before_manifest", {"shard": self.shard}),
                logprobs=backend.capture_logprobs,
            )
        except EngineError as e:  # the engine died mid-shard: the one line names the shard too
            writer.abort()
            raise EngineError(f"shard {self.shard}: {e}") from e
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()  # on a failure too: the log shows how far the shard got
        log.info(
            f"shard {self.shard}: done, {tokens / max(elapsed, 1e-9):.0f} tok/s, "
            f"{sum(f['bytes'] for f in manifest.files.values()) / 2**20:.1f} MiB in "
            f"{', '.join(layer_file(i) for i in self.spec.layer_ids)}"
        )
        return manifest

    def _timings(self, backend: CaptureBackend, tokens: int, t_loaded: float, elapsed: float) -> dict[str, Any]:
        """timings.json: where the job's time went, and what differs between runs of the same shard."""
        return {
            "engine_start_s": round(t_loaded - self.t0, 3),
            "capture_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
            # Wall-clock (Unix) times: jobs that ran at once can be told apart by their overlap.
            "started_at": round(self.t0, 3),
            "capture_started_at": round(t_loaded, 3),
            "capture_ended_at": round(t_loaded + elapsed, 3),
            **({"gpu_claim": self.claim} if self.claim is not None else {}),
            **self.info.volatile,
            **({"writer": backend.capture_stats} if backend.capture_stats else {}),
        }

    def _logprob_rows(self) -> tuple[int, ...]:
        """extract.logprob_rows rows of the shard, spread evenly (the same rows on every rerun)."""
        n, k = len(self.index), min(self.settings.content.logprob_rows, len(self.index))
        return tuple(sorted({i * n // k for i in range(k)})) if k else ()

    def _manifest_fields(self) -> dict[str, Any]:
        index, spec = self.index, self.spec
        return {
            "shard": self.shard,
            "layer_id_convention": CONVENTION,
            "num_hidden_layers": self.info.num_hidden_layers,
            "hidden_size": self.info.hidden_size,
            "dtype": spec.dtype,
            "row_range": [index[0].row, index[-1].row + 1] if index else [0, 0],
            "tokenized": {"path": str(self.tokenized), "sha256": sha256_file(self.tokenized)},
            "model": model_identity(spec.model_path, spec.trust_remote_code),
            "tokenizer": tokenizer_identity(spec.model_path),
            "engine": self.info.manifest_entry(),
            "code_version": self.version,
        }
