"""ShardWriter: one shard folder from token ids to manifest (DESIGN.md §4).

The layer files come from a LayerSink (shard/sink.py), wherever the backend runs it; this writer
owns everything else: the token ids (taken from the batches as the backend reads them), index.json,
timings.json and, last, manifest.json. abort() removes every file of an unfinished shard.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..infra import faults
from ..infra.atomic import atomic_open, write_json
from ..infra.disk import disk_full_is_user_error
from ..infra.folder import file_entry, finish_folder
from ..records import IndexEntry
from .files import StreamingSafetensorsWriter
from .formats import StorageFormat
from .layout import INDEX, LOGPROBS, MANIFEST, TIMINGS, TOKEN_IDS, layer_file, temp_of
from .manifest import ShardManifest
from .sink import SinkPlan, SinkSpec


class ShardWriter:
    """Streams a shard's token ids as batches pass; checks the layer files and writes the manifest last."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        layer_ids: list[int],
        hidden_size: int,
        dtype: str,
        index: list[IndexEntry],
        storage: StorageFormat,
    ):
        self.out_dir = Path(out_dir)
        self.storage = storage
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = list(layer_ids)
        self.index = index
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.total_tokens = sum(e.length for e in index)
        self._placed: list[Path] = []  # files this writer renamed into place; abort() removes them
        self.tokens = StreamingSafetensorsWriter(self.out_dir / TOKEN_IDS, "token_ids", "int64", (self.total_tokens,))

    def sink_spec(self, plan: SinkPlan, logprob_rows: tuple[int, ...] = ()) -> SinkSpec:
        """What the backend's LayerSink needs to write this shard's layer files: this shard's layout, and
        the step size, slots and tag prefix the probed backend reported (`plan`)."""
        return SinkSpec(
            layer_paths={lid: str(self.out_dir / layer_file(lid)) for lid in self.layer_ids},
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            rows=[(e.offset, e.length) for e in self.index],
            step_tokens=plan.step_tokens,
            slots=plan.slots,
            tag_prefix=plan.tag_prefix,
            logprob_rows=logprob_rows,
            storage=self.storage,
        )

    def tee(
        self, batches: Iterator[list[list[int]]], on_batch: Callable[[int, list[list[int]]], None] | None = None
    ) -> Iterator[list[list[int]]]:
        """Pass the batches on to the backend, writing each one's token ids first."""
        import torch

        for b, batch in enumerate(batches):
            self.tokens.append(torch.tensor([t for row in batch for t in row], dtype=torch.int64))  # [sum_T]
            yield batch
            if on_batch is not None:
                on_batch(b, batch)

    def finish(
        self,
        layer_entries: dict[int, dict[str, Any]],
        manifest: dict[str, Any],
        timings: dict[str, Any] | None = None,
        kill_point: tuple[str, dict[str, Any]] | None = None,
        logprobs: dict[int, Any] | None = None,
    ) -> ShardManifest:
        """Check the sink's layer files, close the token ids, write index.json (and the engine's
        prompt logprobs of a few rows, `logprobs` {row: [T-1]}), then timings.json and manifest.json last
        (infra.folder.finish_folder, passing `kill_point`)."""
        files = {}
        if sorted(layer_entries) != self.layer_ids:
            raise ValueError(f"the backend wrote layers {sorted(layer_entries)}, expected {self.layer_ids}")
        (name, dtype, shape), *after = self.storage.tensors(self.total_tokens, self.hidden_size, self.dtype)
        want = {"shape": list(shape), "dtype": dtype, **{n: {"dtype": d, "shape": list(s)} for n, d, s in after}}
        data_bytes = self.total_tokens * self.storage.token_bytes(self.hidden_size, self.dtype)
        for lid in self.layer_ids:
            path, entry = self.out_dir / layer_file(lid), layer_entries[lid]
            self._placed.append(path)
            size = path.stat().st_size if path.is_file() else None
            got = {k: entry.get(k) for k in want}
            # The header is the only part whose size the layout does not fix; data must be exactly the tensors'.
            if size != entry["bytes"] or got != want or not 0 < entry["bytes"] - data_bytes <= 1 << 20:
                raise ValueError(
                    f"{path}: {size} bytes on disk, its entry says {entry['bytes']} bytes of {got}; expected {want} "
                    f"({data_bytes} bytes of data, {self.storage.name} storage)"
                )
            files[path.name] = entry
            faults.kill_point("shard.between_files", file=path.name)
        files[TOKEN_IDS] = self.tokens.finish()
        self._placed.append(self.tokens.path)
        faults.kill_point("shard.before_index", dir=self.out_dir.name)
        self._placed.append(self.out_dir / INDEX)
        with disk_full_is_user_error(self.out_dir / INDEX):
            write_json(self.out_dir / INDEX, [e.to_json() for e in self.index])
        files[INDEX] = file_entry(self.out_dir / INDEX)
        if logprobs:
            files[LOGPROBS] = self._write_logprobs(logprobs)
        if timings is not None:
            self._placed.append(self.out_dir / TIMINGS)
        result = ShardManifest(
            **manifest,
            files=files,
            rows=len(self.index),
            tokens=self.total_tokens,
            layer_ids=self.layer_ids,
            storage=self.storage.manifest_entry,
            format=self.storage.mark,
        )
        with disk_full_is_user_error(self.out_dir / MANIFEST):
            finish_folder(self.out_dir, result.to_json(), timings, kill_point)
        self._placed = []  # finished: the files now belong to the manifest
        return result

    def _write_logprobs(self, logprobs: dict[int, Any]) -> dict[str, Any]:
        """logprobs.safetensors: rows [k] (positions in the index), offsets [k+1], logprobs [sum(T-1)] f32."""
        import torch
        from safetensors.torch import save

        rows = sorted(logprobs)
        lengths = [int(logprobs[r].numel()) for r in rows]
        blob = save(
            {
                "rows": torch.tensor(rows, dtype=torch.int64),
                "offsets": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64),
                "logprobs": torch.cat([logprobs[r].float() for r in rows]),
            }
        )
        path = self.out_dir / LOGPROBS
        self._placed.append(path)
        with disk_full_is_user_error(path), atomic_open(path, "wb") as f:
            f.write(blob)
        return {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}

    def abort(self) -> None:
        """Remove every file of the unfinished shard: temp files, and those already renamed into place."""
        self.tokens.abort()
        for lid in self.layer_ids:
            path = self.out_dir / layer_file(lid)
            temp_of(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        for p in self._placed:
            p.unlink(missing_ok=True)
        self._placed = []
