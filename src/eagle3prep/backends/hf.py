"""transformers capture backend: the demo backend, and the one every engine is compared with.

Hooks sit where layers.hook_point puts each id (the vLLM worker uses the same map); each batch is
one forward step into the LayerSink, in this process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import UserError
from ..layers import decoder_stack, hook_point
from ..shard.sink import LayerSink, Segment, SinkPlan
from ..tokenize.row_inputs import ImageRow, RowImages, load_target
from .base import CaptureBackend, CaptureSpec, EngineInfo, smoke_shard

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..shard.sink import SinkSpec

HOST_SLOTS = 3  # one step being filled, up to two with the writer threads


def _first_tensor(x: Any) -> Any:
    return x[0] if isinstance(x, tuple) else x


class HFBackend(CaptureBackend):
    name = "hf"

    def __init__(self, spec: CaptureSpec):
        super().__init__(spec)
        self.model = None
        self._captured: dict[int, Any] = {}
        self._handles: list[Any] = []
        self._row_images: RowImages | None = None

    def probe(self) -> EngineInfo:
        import torch
        import transformers

        if self.spec.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(
                f"extract.device = {self.spec.device} but torch sees no CUDA GPU here; set extract.device: cpu"
            )
        self.model = load_target(
            self.spec.model_path, getattr(torch, self.spec.dtype), self.spec.trust_remote_code
        ).to(self.spec.device)
        self.model.eval()
        self.base = decoder_stack(self.model)
        n = len(self.base.layers)
        for lid in self.spec.layer_ids:
            layer, side = hook_point(lid, n)
            module = self.base.layers[layer]
            if side == "input":
                self._handles.append(module.register_forward_pre_hook(self._input_hook(lid), with_kwargs=True))
            else:
                self._handles.append(module.register_forward_hook(self._output_hook(lid)))
        hidden = self.model.config.get_text_config().hidden_size
        smoke_shard(self, [1, 2, 3], hidden)
        return EngineInfo(
            engine="transformers",
            engine_version=transformers.__version__,
            capture_path="hf_hooks",
            tp_size=1,
            dtype=self.spec.dtype,
            num_hidden_layers=n,
            hidden_size=hidden,
            final_layer_reachable=True,
            details={"torch_version": torch.__version__, "device": self.spec.device},
        )

    def sink_plan(self) -> SinkPlan:
        # one padded batch is one step: extract.batch_tokens bounds its rows x longest
        return SinkPlan(step_tokens=self.settings.speed.batch_tokens, slots=HOST_SLOTS, tag_prefix="row")

    def _input_hook(self, lid: int):
        def hook(module, args, kwargs):
            self._captured[lid] = args[0] if args else kwargs["hidden_states"]  # [B, T, H]

        return hook

    def _output_hook(self, lid: int):
        def hook(module, args, output):
            self._captured[lid] = _first_tensor(output)  # [B, T, H]

        return hook

    def capture_shard(self, batches: Iterator[list[list[int]]], sink: SinkSpec) -> dict[int, dict[str, Any]]:
        out = LayerSink(sink)
        self.capture_logprobs = {}
        try:
            first = 0
            for batch in batches:
                wanted = [i for i in range(len(batch)) if first + i in sink.logprob_rows]
                logprobs = self._step(out, batch, [sink.tag(first + i) for i in range(len(batch))], wanted)
                self.capture_logprobs.update({first + i: lp for i, lp in logprobs.items()})
                first += len(batch)
            return out.finish()
        except BaseException:
            out.abort()
            raise

    def _step(self, sink: LayerSink, batch: list[list[int]], tags: list[str], wanted: list[int]) -> dict[int, Any]:
        """One padded forward of the base model; its valid rows go to the sink as one step. Returns
        the prompt logprobs of the `wanted` rows of the batch, from this model's own lm_head."""
        import torch

        lengths = [len(r) for r in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)  # right padding: causal attention
        mask = torch.zeros(len(batch), max(lengths), dtype=torch.long)  # never lets a row see its pads
        for i, row in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        self._captured = {}
        images = self._images(batch, ids)
        with torch.inference_mode():
            # The base model only: the LM head's [B, T, vocab] logits are not needed. With images, the
            # wrapper's base (vision tower, merged embeddings, 3-D rope positions), whose language model is hooked.
            base = self.model.model if images else self.base
            out = base(
                input_ids=ids.to(self.spec.device), attention_mask=mask.to(self.spec.device), use_cache=False,
                **{k: v.to(self.spec.device) for k, v in images.items()},
            )  # fmt: skip
            logprobs = {i: self._logprobs(out.last_hidden_state[i, : lengths[i]], batch[i]) for i in wanted}
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        sink.begin_step([Segment(t, 0, s, s + n) for t, s, n in zip(tags, starts, lengths, strict=True)])
        for lid in sorted(self.spec.layer_ids):
            hs = self._captured[lid]  # [B, T_max, H]
            sink.add_layer(lid, torch.cat([hs[i, :n] for i, n in enumerate(lengths)]))  # [sum_T, H], a new tensor
        self._captured = {}
        return logprobs

    def _images(self, batch: list[list[int]], ids: Any) -> dict[str, Any]:
        """The image inputs of a batch (row_inputs.RowImages.batch); {} for text rows only."""
        rows = [r for r in batch if isinstance(r, ImageRow)]
        if not rows:
            return {}
        if self._row_images is None or self._row_images.tokenized != rows[0].tokenized:
            self._row_images = RowImages(self.spec.model_path, rows[0].tokenized)
        return self._row_images.batch([r.row if isinstance(r, ImageRow) else {} for r in batch], ids)

    def _logprobs(self, normed: Any, row: list[int]) -> Any:
        """[T-1] float32: log p(token t | tokens < t), t >= 1, from the final-norm output [T, H]."""
        import torch

        logits = self.model.get_output_embeddings()(normed[:-1]).float()  # [T-1, vocab]
        ids = torch.tensor(row[1:], dtype=torch.long, device=logits.device)
        return torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0].cpu()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model = None
