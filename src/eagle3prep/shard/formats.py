"""The storage formats of a layer file (`extract.storage`): the one place that knows each.

Each format says what tensors a layer file holds, how rows are encoded on their device and decoded on read, its
bytes per token, the manifest marks that name it, the rounding it may add (what validation widens its bounds by)
and what speculators' export makes of it. A name is resolved once, where it enters (the extract job's CaptureSpec,
a manifest, the plan's config), and the StorageFormat itself travels from there; nothing else tells formats apart
by name:

    fmt = storage_format(settings.content.storage)   # or manifest.storage_format
    fmt.tensors(tokens, hidden_size, dtype)   # [(name, dtype, shape)] in file order
    fmt.encode(x)                             # (values, scales...) on x's device; () parts for model_dtype
    fmt.decode(parts, dtype)                  # [n, H]
    fmt.roundtrip(x), fmt.draw(x, generator)  # the rounding floor (validation)
    fmt.speculators_backend, fmt.export_copy  # what speculators' export stores and trains from

Formats: `model_dtype` (as captured), `fp8_e4m3` (one float32 scale per token; speculators' own math, fp8.py),
`mxfp4` (4-bit e2m1 with a power-of-two scale per 32 values, mxfp4.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import fp8, kernels, mxfp4

if TYPE_CHECKING:
    import torch

# torch dtype name -> (safetensors dtype code, bytes per element)
DTYPES = {
    "bfloat16": ("BF16", 2),
    "float16": ("F16", 2),
    "float32": ("F32", 4),
    "int64": ("I64", 8),
    "uint8": ("U8", 1),
    fp8.FP8_DTYPE: ("F8_E4M3", 1),
}
VALUES_KEY = "hidden_states"
SCALES_KEY = fp8.SCALES_KEY  # every scaled format keeps its scales under speculators' key
MODEL_DTYPE, FP8_E4M3, MXFP4 = "model_dtype", "fp8_e4m3", "mxfp4"
FORMAT = "eagle3prep.hidden_states/1"
# A scaled layer file holds a second tensor and values older readers would misread: each mark is refused by
# readers that predate it.
FORMAT_FP8 = "eagle3prep.hidden_states/2"
FORMAT_MXFP4 = "eagle3prep.hidden_states/3"


@dataclass(frozen=True)
class StorageFormat:
    name: str
    label: str  # in messages: "FP8 floor"
    mark: str  # the manifest's `format`
    summary: str  # one phrase for the report, plan and logs
    values_dtype: Callable[[str], str]  # the model dtype -> the stored values' dtype
    scales: tuple[str, Callable[[int], int]] | None = None  # (dtype, per-row count from the hidden size)
    quantize: Callable[[Any], tuple[Any, ...]] | None = None
    dequantize: Callable[..., Any] | None = None
    rounding_draw: Callable[[Any, Any], Any] | None = None
    entry: dict[str, Any] = field(default_factory=dict)  # the manifest's `storage` field (empty: left out)
    check_width: Callable[[int], None] = lambda hidden_size: None
    # Rows encoded at once on the device: the temporaries of a chunk are a few x its float32 size
    # (Kimi's H 7168: ~200 MiB at 4096 rows), outside what vLLM's memory profile saw.
    chunk: int = fp8.QUANT_CHUNK
    packing: int = 1  # model values a stored element holds (MXFP4: two a byte)
    # Each layer file's safetensors metadata, beside the storage name and the model dtype (metadata()): how its
    # values are stored, so a reader needs no manifest.
    described: dict[str, str] = field(default_factory=dict)
    # speculators' `train --hidden-states-backend` for the export of this storage: `file` reads decoded rows, `fp8`
    # reads FP8 values and scales as stored (its FP8Transfer), so the export copies those bytes unrounded.
    speculators_backend: str = "file"
    export_entry: dict[str, Any] = field(default_factory=dict)  # the export manifest's `storage` (empty: left out)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # By name: a format holds functions, and the one a name gives in another process is the same table row.
        return storage_format, (self.name,)

    @property
    def scaled(self) -> bool:
        return self.scales is not None

    @property
    def manifest_entry(self) -> dict[str, Any] | None:
        """The shard manifest's `storage` field: None (left out) for model-dtype shards, so their manifests stay as
        they were."""
        return self.entry or None

    @property
    def exports_scales(self) -> bool:
        """speculators reads this storage's values and scales itself: the export keeps both as stored, and a reader
        standing in for speculators' trainer decodes them with its math."""
        return self.speculators_backend != "file"

    @property
    def export_copy(self) -> StorageFormat:
        """How the export's hs files (export.hidden_states: copy) store the rows: as the shards do, or decoded to
        the model's dtype where speculators cannot read the stored bytes (MXFP4: it reads no 4-bit)."""
        return self if self.exports_scales or not self.scaled else FORMATS[MODEL_DTYPE]

    def tensors(self, tokens: int, hidden_size: int, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor of a layer file, in file order: the values, then any scales."""
        self.check_width(hidden_size)
        out = [(VALUES_KEY, self.values_dtype(dtype), (tokens, hidden_size // self.packing))]
        if self.scales is not None:
            sdtype, count = self.scales
            out.append((SCALES_KEY, sdtype, (tokens, count(hidden_size))))
        return out

    def token_bytes(self, hidden_size: int, dtype: str) -> int:
        """Bytes one token takes in one layer file (values and scales)."""
        return sum(DTYPES[d][1] * shape[1] for _, d, shape in self.tensors(1, hidden_size, dtype))

    def metadata(self, model_dtype: str) -> dict[str, str]:
        """A layer file's safetensors `__metadata__` (strings only): the format's mark and name, the dtype the
        model computed in and the one stored, and how to read the values back."""
        return {
            "format": self.mark,
            "storage": self.name,
            "model_dtype": model_dtype,
            "stored_dtype": self.values_dtype(model_dtype),
            **self.described,
        }

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stored tensors of rows `x` [n, H], on x's device, in file order."""
        return (x,) if self.quantize is None else self.quantize(x)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """[n, H] from the stored tensors; `dtype` None: a model-dtype file as stored, a quantized one as bfloat16
        (what trainers read)."""
        import torch

        if self.dequantize is None:
            return parts[0] if dtype is None else parts[0].to(dtype)
        return self.dequantize(*parts, dtype or torch.bfloat16)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """`x` through this storage and back, float32: what a right capture of `x` reads as."""
        import torch

        return self.decode(self.encode(x), torch.float32) if self.scaled else x.float()

    def draw(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A value this storage could have rounded to `x` (float32); `x` itself for model_dtype."""
        return x.float() if self.rounding_draw is None else self.rounding_draw(x, generator)


FORMATS: dict[str, StorageFormat] = {
    f.name: f
    for f in (
        StorageFormat(
            MODEL_DTYPE,
            "model dtype",
            FORMAT,
            "the model dtype",
            lambda dtype: dtype,
            described={"values": f"{VALUES_KEY} [tokens, hidden] in the model dtype, as captured", "rounding": "none"},
        ),
        StorageFormat(
            FP8_E4M3,
            "FP8",
            FORMAT_FP8,
            "FP8 e4m3 with a float32 scale per token",
            lambda _: fp8.FP8_DTYPE,
            ("float32", lambda h: 1),
            kernels.quantize_fp8,  # fp8.quantize_fp8's bytes, by the kernel where it runs
            fp8.dequantize_fp8,
            fp8.rounding_draw,
            {
                "name": FP8_E4M3,
                "dtype": fp8.FP8_DTYPE,
                "scales": {
                    "key": SCALES_KEY,
                    "dtype": "float32",
                    "granularity": "per_token_per_layer",  # one scale per token in each layer file
                    "math": f"scale = max(amax / {fp8.FP8_MAX:g}, {fp8.SCALE_MIN:g}); value = fp8 x scale "
                    "(speculators' fp8_utils)",
                },
            },
            described={
                "values": f"{VALUES_KEY} [tokens, hidden] float8_e4m3fn",
                "scales": f"{SCALES_KEY} [tokens, 1] float32, one per token: scale = max(amax / {fp8.FP8_MAX:g}, "
                f"{fp8.SCALE_MIN:g}) (speculators' fp8_utils)",
                "rounding": "x / scale rounded to nearest, ties to even (torch's float32 -> float8_e4m3fn)",
                "decode": "value = float32(e4m3) x scale",
            },
            speculators_backend="fp8",
            export_entry={
                "name": FP8_E4M3,
                "dtype": fp8.FP8_DTYPE,
                "scales": {"key": SCALES_KEY, "shape": "[T, L, 1]"},
            },
        ),
        StorageFormat(
            MXFP4,
            "MXFP4",
            FORMAT_MXFP4,
            f"MXFP4: 4-bit e2m1 with a power-of-two scale per {mxfp4.BLOCK} values",
            lambda _: "uint8",
            ("uint8", lambda h: h // mxfp4.BLOCK),
            kernels.quantize_mxfp4,  # the Triton kernel on CUDA, else mxfp4.quantize_mxfp4
            mxfp4.dequantize_mxfp4,
            mxfp4.rounding_draw_mxfp4,
            {
                "name": MXFP4,
                "dtype": "uint8",
                "values": "e2m1 (OCP MX v1.0), two per byte, element 2i in the low nibble, sign in bit 3",
                "rounding": mxfp4.ROUNDING,
                "scales": {
                    "key": SCALES_KEY,
                    "dtype": "uint8",
                    "granularity": f"per_{mxfp4.BLOCK}_values",
                    "math": "e8m0: byte b = 2^(b - 127); the smallest power of two with amax / scale <= 6",
                },
            },
            mxfp4.check_width,
            packing=2,
            described={
                "values": f"{VALUES_KEY} [tokens, hidden / 2] uint8: e2m1 codes (OCP MX v1.0: magnitudes 0, 0.5, 1, "
                "1.5, 2, 3, 4, 6 for codes 0-7, bit 3 the sign)",
                "packing": "two codes a byte: element 2i in the low nibble, element 2i + 1 in the high nibble",
                "scales": f"{SCALES_KEY} [tokens, hidden / {mxfp4.BLOCK}] uint8 e8m0, one per {mxfp4.BLOCK} "
                "consecutive values: byte b = 2^(b - 127), 255 = NaN (that block holds a NaN or an Inf)",
                "scale_choice": "the smallest power of two with amax / scale <= 6 (rounded up: no value clips)",
                "rounding": mxfp4.ROUNDING,
                "decode": "value = e2m1[code & 7] x (-1 if code & 8) x 2^(b - 127)",
            },
            # The shards' 4-bit values decoded to bfloat16, exactly: `export.hidden_states: direct` keeps them 4-bit.
            export_entry={"name": MXFP4, "copy": "decoded to bfloat16"},
        ),
    )
}
STORAGES = tuple(FORMATS)
MARKS = {f.mark: f for f in FORMATS.values()}


def storage_format(storage: str) -> StorageFormat:
    """The format named `storage` (extract.storage, or a manifest's storage name)."""
    try:
        return FORMATS[storage]
    except KeyError:
        raise ValueError(f"extract.storage = {storage!r} is not one of {list(STORAGES)}") from None


def storage_of_entry(entry: dict[str, Any] | None) -> str:
    """The storage name a shard manifest's `storage` field gives; a manifest without one is a model-dtype shard's."""
    return (entry or {}).get("name", MODEL_DTYPE)


def format_of_file(tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None) -> StorageFormat:
    """The format a layer file is stored in: the one its metadata names (files written since they carry it), else
    from its tensors ({name: (safetensors dtype code, shape)})."""
    named = (metadata or {}).get("storage")
    if named is not None:
        fmt = storage_format(named)
        if fmt.scaled != (SCALES_KEY in tensors):
            raise ValueError(f"its metadata names storage {named!r}, its tensors are {sorted(tensors)}")
        return fmt
    if SCALES_KEY not in tensors:
        return FORMATS[MODEL_DTYPE]
    return FORMATS[MXFP4] if tensors[VALUES_KEY][0] == "U8" else FORMATS[FP8_E4M3]
