"""A tokenized row with images -> the target's model inputs, in one place: the hf
capture backend, validation's transformers reference, the scalable window check and the planted mistakes all
take a row's pixels and positions from here, so a capture and its check cannot disagree on how an image
enters the model.

The pixels are re-made from the row's recorded images (a path, or for a `data:` URI kept in the conversation,
the prepared conversation of the row's id, found through the tokenize folder's stats.json) by the target's
image processor, and must give back the sha256 and the `image_grid_thw` tokenize recorded, and as many
vision tokens as the row's input_ids hold: a changed image or processor stops the job in one line instead of
capturing other pixels than the rows were tokenized for.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from eagle3prep.errors import UserError
from eagle3prep.tokenize.template import Rejected
from eagle3prep.tokenize.vision import image_parts, load_image


def is_vision_target(model_path: str | os.PathLike) -> bool:
    """Whether config.json describes a vision-language wrapper (a `vision_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return "vision_config" in config


def load_target(model_path: str | os.PathLike, dtype: Any, trust_remote_code: bool):
    """The target as transformers runs it: AutoModelForCausalLM, or for a vision-language target the whole
    image-text model (vision tower included; AutoModelForCausalLM does not map Qwen2.5-VL's config)."""
    import transformers

    auto = (
        transformers.AutoModelForImageTextToText if is_vision_target(model_path) else transformers.AutoModelForCausalLM
    )
    return auto.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)


class ImageRow(list):
    """A row's input_ids as every backend takes a row (a list), carrying its tokenized row and shard, so that
    a backend that feeds images re-makes its pixels (RowImages) and one that does not is unchanged."""

    def __init__(self, row: dict[str, Any], tokenized_shard: str | os.PathLike):
        super().__init__(row["input_ids"])
        self.row, self.tokenized = row, str(tokenized_shard)


class RowImages:
    """Model inputs of the rows of one tokenized shard: `inputs(row)` for one row, `batch(rows, ids)` for a
    right-padded batch. The image processor and the conversations are read on first need. `images(row)` may
    run on several threads at once (the vllm backend loads rows ahead on a pool): what it reads lazily is
    made under a lock."""

    def __init__(self, model_path: str | os.PathLike, tokenized_shard: str | os.PathLike):
        self.model_path, self.tokenized = str(model_path), str(tokenized_shard)
        self._config = self._processor = None
        self._rope = None  # the model class on the meta device, for its get_rope_index
        self._uris: dict[str, str] | None = None  # sha256 -> data: URI of the conversations' inline images
        self._lock = threading.Lock()  # config and _uris: made once, whichever thread needs them first

    @property
    def config(self):
        if self._config is None:
            with self._lock:
                if self._config is None:
                    from transformers import AutoConfig

                    self._config = AutoConfig.from_pretrained(self.model_path)
        return self._config

    @property
    def image_token_id(self) -> int | None:
        return getattr(self.config, "image_token_id", None)

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoImageProcessor

            self._processor = AutoImageProcessor.from_pretrained(self.model_path)
        return self._processor

    def _where(self, row: dict[str, Any]) -> str:
        return f"{self.tokenized}: row {row['row']}"

    def images(self, row: dict[str, Any]) -> list[Any]:
        """A row's images as RGB PIL images, each checked against its recorded sha256 (what an engine that runs
        the image processor itself, vLLM, is given; pixels() checks the processor's grid on them too)."""
        if self.image_token_id is None:
            raise UserError(f"{self._where(row)} has images; {self.model_path} is not a vision-language target")
        pils = []
        for k, image in enumerate(row["images"]):
            ref = image["image"] if image["image"] is not None else self._inline(row, image["sha256"], k)
            got = load_image({"image": ref, "sha256": image["sha256"]}, k)
            if isinstance(got, Rejected):
                raise UserError(f"{self._where(row)}, field images: {got.detail}")
            pils.append(got)
        return pils

    def pixels(self, row: dict[str, Any]) -> dict[str, Any]:
        """{"pixel_values": [patches, C] float32, "image_grid_thw": [n, 3] int64} of a row's images, checked
        against its sha256, image_grid_thw and vision tokens."""
        import torch

        out = self.processor(images=self.images(row), return_tensors="pt")
        grids = out["image_grid_thw"].tolist()
        if grids != row["image_grid_thw"]:
            raise UserError(
                f"{self._where(row)}, field image_grid_thw: the image processor gives {grids}, tokenize recorded "
                f"{row['image_grid_thw']}; {self.model_path}'s image processor changed since tokenize: re-run it"
            )
        merge = int(getattr(self.processor, "merge_size", 2))
        want = sum(t * h * w for t, h, w in grids) // merge**2
        have = sum(t == self.image_token_id for t in row["input_ids"])
        if have != want:
            raise UserError(
                f"{self._where(row)}, field input_ids: {have} image tokens for images of {want} vision tokens"
            )
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].to(torch.long)}

    def _inline(self, row: dict[str, Any], sha256: str, k: int) -> str:
        """The data: URI of image k, from the prepared conversations tokenize read (its stats.json says which)."""
        if self._uris is None:
            with self._lock:  # one thread reads the conversations; a failed read is tried again by the next row
                if self._uris is None:
                    self._uris = self._read_uris(row, k)
        if sha256 not in self._uris:
            raise UserError(
                f"{self._where(row)}, field images: image {k} (sha256 {sha256[:12]}...) is in no conversation of "
                "the prepared data; re-run prepare and tokenize"
            )
        return self._uris[sha256]

    def _read_uris(self, row: dict[str, Any], k: int) -> dict[str, str]:
        stats = Path(self.tokenized).parent / "stats.json"
        try:
            path = json.loads(stats.read_text(encoding="utf-8"))["conversations_path"]
            with open(path, encoding="utf-8") as f:
                return {p["sha256"]: p["image"] for line in f
                        for p in image_parts(json.loads(line)["messages"]) if p["image"].startswith("data:")}  # fmt: skip
        except (OSError, ValueError, KeyError) as e:
            raise UserError(
                f"{self._where(row)}, field images: image {k} is a data: URI kept in the conversation, and "
                f"the conversations cannot be read through {stats} ({e}); re-run tokenize"
            ) from None

    def inputs(self, row: dict[str, Any]) -> dict[str, Any]:
        """The model's keyword inputs for one row (batch of 1): input_ids, and for a row with images
        pixel_values, image_grid_thw and mm_token_type_ids (transformers computes Qwen2.5-VL's 3-D rope
        positions only when given the last)."""
        import torch

        ids = torch.tensor([row["input_ids"]], dtype=torch.long)
        return {"input_ids": ids, **self.batch([row], ids)}

    def image_inputs(self, row: dict[str, Any]) -> dict[str, Any]:
        """inputs(row) without input_ids: what a forward given the row's token ids adds for its images."""
        return {k: v for k, v in self.inputs(row).items() if k != "input_ids"}

    def batch(self, rows: list[dict[str, Any]], ids) -> dict[str, Any]:
        """The image inputs of a batch of rows whose padded input_ids are `ids` [B, T]; {} when none has images."""
        import torch

        with_images = [r for r in rows if r.get("images")]
        if not with_images:
            return {}
        pix = [self.pixels(r) for r in with_images]  # in row order: transformers fills image tokens row-major
        return {
            "pixel_values": torch.cat([p["pixel_values"] for p in pix]),
            "image_grid_thw": torch.cat([p["image_grid_thw"] for p in pix]),
            "mm_token_type_ids": (ids == self.image_token_id).to(torch.int),
        }

    def positions(self, row: dict[str, Any]):
        """[3, 1, T] rope positions of one row (Qwen2.5-VL's 3-D positions; a text row's are 0..T-1 on every
        axis), as the whole model computes them: for forwards that run decoder layers alone (validate/window.py)."""
        import torch

        ids = torch.tensor([row["input_ids"]], dtype=torch.long)
        if not row.get("images"):
            return torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        if self._rope is None:
            from transformers import AutoModel

            with torch.device("meta"):  # get_rope_index reads only the config: no weights are made
                self._rope = AutoModel.from_config(self.config)
        grid = torch.tensor(row["image_grid_thw"], dtype=torch.long)
        pos, _ = self._rope.get_rope_index(ids, (ids == self.image_token_id).to(torch.int), image_grid_thw=grid)
        return pos
