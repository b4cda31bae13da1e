"""Planted capture mistakes: copies of a correct shard made wrong the ways real capture code goes wrong (and,
for rows with images, the ways it feeds the images wrong: IMAGE_MISTAKES).

Each planted shard keeps a manifest whose checksums agree with its files, so only the reference check
can catch it. Used by bench/validation_matrix.py and the tests to show that validation fails each one.
The source shard must hold every id the mistakes borrow from (the matrix captures ids 1..N). A planted
copy is stored as its source is: an FP8 shard's rows are read dequantized, made wrong, and quantized
again the way the capture quantizes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3prep.infra.atomic import sha256_file
from eagle3prep.shard.formats import MODEL_DTYPE
from eagle3prep.shard.layout import MANIFEST, layer_file
from eagle3prep.shard.manifest import read_manifest
from eagle3prep.shard.readers import read_index, read_layer
from eagle3prep.shard.tokenized import rows as tokenized_rows

from testkit.writers import write_layer

MISTAKES = (
    "layer_plus_one",  # every id k < N holds id k + 1
    "layer_minus_one",  # every id k holds id k - 1
    "post_norm_final",  # id N holds the final norm's output instead of its input
    "rows_swapped",  # two requests of equal length exchanged
    "tokens_shifted",  # every row's states one position early (token t holds t + 1)
    "scaled",  # every layer x 1/routed_scaling_factor (DeepSeek's fp16 residual scaling)
    "other_shard",  # the rows of another shard
)


def _load(shard: Path, lid: int):
    """[sum_T, H] as stored, or float32 from an FP8 file."""
    import torch

    fp8 = read_manifest(shard).storage_name != MODEL_DTYPE
    return read_layer(shard / layer_file(lid), dtype=torch.float32 if fp8 else None)


def _row_slices(shard: Path) -> list[slice]:
    return [slice(e.offset, e.offset + e.length) for e in read_index(shard)]


def _equal_length_pair(shard: Path) -> tuple[slice, slice]:
    by_len: dict[int, slice] = {}
    for s in _row_slices(shard):
        n = s.stop - s.start
        if n in by_len:
            return by_len[n], s
        by_len[n] = s
    raise ValueError(f"{shard}: no two rows of equal length to swap")


def plant(
    mistake: str,
    source: Path,
    out: Path,
    layer_ids: list[int],
    final_norm: Callable[[Any], Any] | None = None,
    scale: float = 2.5,
    other: Path | None = None,
) -> Path:
    """Write `out`: shard `source` reduced to `layer_ids`, made wrong by `mistake` (one of MISTAKES).

    `final_norm` maps the pre-norm final state to the model's final-norm output (post_norm_final);
    `other` is another shard of the same model (other_shard).
    """
    manifest = read_manifest(source)
    n = manifest.num_hidden_layers
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("layer_*.safetensors", MANIFEST))
    rows = _row_slices(source)
    for lid in layer_ids:
        hs = _load(source, lid)
        if mistake == "layer_plus_one" and lid < n:
            hs = _load(source, lid + 1)
        elif mistake == "layer_minus_one" and lid > 0:
            hs = _load(source, lid - 1)
        elif mistake == "post_norm_final" and lid == n:
            hs = final_norm(hs.float()).to(hs.dtype)
        elif mistake == "rows_swapped":
            a, b = _equal_length_pair(source)
            hs = hs.clone()
            hs[a], hs[b] = hs[b].clone(), hs[a].clone()
        elif mistake == "tokens_shifted":
            hs = hs.clone()
            for s in rows:
                if s.stop - s.start > 1:
                    hs[s.start : s.stop - 1] = hs[s.start + 1 : s.stop].clone()
        elif mistake == "scaled":
            hs = (hs.float() / scale).to(hs.dtype)
        elif mistake == "other_shard":
            theirs = _load(other, lid)
            reps = -(-hs.shape[0] // max(theirs.shape[0], 1))
            hs = theirs.repeat(reps, 1)[: hs.shape[0]].clone()
        elif mistake not in MISTAKES:
            raise ValueError(f"unknown mistake {mistake!r}; one of {MISTAKES}")
        write_layer(out / layer_file(lid), hs, manifest.storage_name)
    return rewrite_manifest(out, manifest, layer_ids)


def rewrite_manifest(out: Path, manifest, layer_ids: list[int]) -> Path:
    """The source's manifest with the checksums of `out`'s layer files, so only the reference check can tell."""
    files = {k: v for k, v in manifest.files.items() if not k.startswith("layer_")}
    for lid in layer_ids:
        path = out / layer_file(lid)
        files[layer_file(lid)] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest.files, manifest.layer_ids = files, list(layer_ids)
    (out / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=True))
    return out


def rerouted(source: Path, out: Path, input_ids: list[int], row: int, token: int, layer: int, model_path: str) -> Path:
    """Write `out`: shard `source` whose row `row` (position in the shard) is the fp32 transformers forward
    with MoE layer `layer` sending `token` to its runner-up expert (routing.force_reroute).

    What another engine captures where that token's router margin is a near-tie; a wrong capture where it
    is not. Every later token of the row moves too (attention carries it), as in a real re-route.
    """
    from eagle3prep.validate.reference import Reference
    from eagle3prep.validate.routing import force_reroute

    manifest = read_manifest(source)
    ref = Reference(model_path, device="cpu", trust_remote_code=False)
    with force_reroute(ref.model, layer, token):
        states = ref.hidden_states(input_ids, manifest.layer_ids)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("layer_*.safetensors", MANIFEST))
    where = _row_slices(source)[row]
    for lid in manifest.layer_ids:
        hs = _load(source, lid).clone()
        hs[where] = states[lid].to(hs.dtype)
        write_layer(out / layer_file(lid), hs, manifest.storage_name)
    return rewrite_manifest(out, manifest, manifest.layer_ids)


IMAGE_MISTAKES = (
    "image_dropped",  # every image row as the model computes it from its token ids alone (no pixels)
    "images_swapped",  # two image rows of equal grids, each computed with the other's image
    "image_shifted",  # every image's vision tokens one position later in the model's input
)


def plant_image(mistake: str, source: Path, out: Path, tokenized_shard: Path, model_path: str) -> Path:
    """Write `out`: shard `source` whose image rows (tokenized_shard's) are the fp32 transformers forward of
    what a capture that got the images wrong was given, by `mistake` (one of IMAGE_MISTAKES)."""
    import torch

    from eagle3prep.tokenize.row_inputs import RowImages
    from eagle3prep.validate.reference import Reference

    manifest = read_manifest(source)
    rows = list(tokenized_rows(tokenized_shard))
    images, ref = RowImages(model_path, tokenized_shard), Reference(model_path, device="cpu", trust_remote_code=False)
    wrong = {}  # position in the shard -> (input_ids, image inputs) the capture was given
    for i, row in enumerate(rows):
        if not row.get("images"):
            continue
        ids = torch.tensor([row["input_ids"]])
        if mistake == "image_dropped":
            wrong[i] = (row["input_ids"], None)
        elif mistake == "image_shifted":
            shifted = _shift_image_tokens(ids[0], images.image_token_id)
            wrong[i] = (shifted.tolist(), images.batch([row], shifted[None]))
    if mistake == "images_swapped":
        a, b = _swappable_pair(rows)
        for x, y in ((a, b), (b, a)):  # row x's tokens with row y's pixels
            wrong[x] = (rows[x]["input_ids"], images.batch([rows[y]], torch.tensor([rows[x]["input_ids"]])))
    elif mistake not in IMAGE_MISTAKES:
        raise ValueError(f"unknown mistake {mistake!r}; one of {IMAGE_MISTAKES}")
    states = {i: ref.hidden_states(ids, manifest.layer_ids, pixels) for i, (ids, pixels) in wrong.items()}
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("layer_*.safetensors", MANIFEST))
    where = _row_slices(source)
    for lid in manifest.layer_ids:
        hs = _load(source, lid).clone()
        for i, got in states.items():
            hs[where[i]] = got[lid].to(hs.dtype)
        write_layer(out / layer_file(lid), hs, manifest.storage_name)
    return rewrite_manifest(out, manifest, manifest.layer_ids)


def _shift_image_tokens(ids, image_token_id: int):
    """`ids` with each run of image tokens one position later (the token after the run moves before it)."""
    ids = ids.clone()
    is_image = (ids == image_token_id).tolist() + [False]
    starts = [k for k in range(len(ids)) if is_image[k] and (k == 0 or not is_image[k - 1])]
    for s in starts:
        e = next(k for k in range(s, len(ids) + 1) if not is_image[k])
        if e == len(ids):
            raise ValueError("an image run ends the row: nothing to shift it past")
        ids[s : e + 1] = ids[[e, *range(s, e)]].clone()
    return ids


def _swappable_pair(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """Two rows with images of equal grids and different bytes (their pixels fit each other's tokens)."""
    seen: dict[str, tuple[int, list[str]]] = {}
    for i, row in enumerate(rows):
        if not row.get("images"):
            continue
        grid, shas = json.dumps(row["image_grid_thw"]), [im["sha256"] for im in row["images"]]
        if grid in seen and seen[grid][1] != shas:
            return seen[grid][0], i
        seen.setdefault(grid, (i, shas))
    raise ValueError("no two rows with images of equal grids and different bytes to swap")
