"""Rows: a chunk of the prepare stage's lines -> encoded, truncated, serialized rows (or quarantine records),
with the chunk's loss-masked token counts. Rows are serialized here, in the worker, so that the parent only
numbers and writes them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eagle3prep.records import Quarantined
from eagle3prep.tokenize.template import ChatEncoder, Rejected, TokenizeError
from eagle3prep.tokenize.vision import refuse_media_in_text


@dataclass(slots=True)
class EncodedChunk:
    """What the encoder makes of a chunk of input lines, ready for the parent to number and write."""

    rows: list[tuple[str, int] | Quarantined]  # per input line: (row JSON after `{"row":N,`, seq_len) or why not
    # Over loss-masked tokens of the kept rows: (token ids, counts), both [n_distinct] int64, ids ascending.
    # Sparse, so that a chunk of a 150k-token vocabulary does not ship 150k zeros.
    token_freq: tuple[Any, Any]
    n_truncated: int
    truncated_tokens: int = 0  # tokens cut from the truncated rows (what training loses)
    images: tuple[int, int, int] = (0, 0, 0)  # kept rows with images, their images, their vision tokens
    trailing_user: int = 0  # kept rows whose conversation ends with a user message (context no reply follows)


def mask_runs(mask: bytearray) -> list[tuple[int, int]]:
    """The [start, end) token ranges where the loss mask is 1 (an assistant reply each, for a chat template)."""
    runs = []
    start = mask.find(1)
    while start >= 0:
        end = mask.find(0, start)
        if end < 0:
            end = len(mask)
        runs.append((start, end))
        start = mask.find(1, end)
    return runs


def row_json_tail(conv_id: str, ids: list[int], runs: list[tuple[int, int]], id_str: list[str]) -> str:
    """`json.dumps(TokenizedRow(...).to_json(), ensure_ascii=False, separators=(",", ":"))` + newline, from
    the key after "row" on: the row number is known only in input order, in the parent. The loss mask is
    given as its `mask_runs`: it is written a run at a time, not a digit at a time."""
    mask, prev = [], 0
    for start, end in runs:
        mask += ("0," * (start - prev), "1," * (end - start))
        prev = end
    mask.append("0," * (len(ids) - prev))
    return (
        f'"id":{json.dumps(conv_id, ensure_ascii=False)},"input_ids":[{",".join(map(id_str.__getitem__, ids))}],'
        f'"loss_mask":[{"".join(mask)[:-1]}],"seq_len":{len(ids)}}}\n'
    )


def encode_lines(
    encoder: ChatEncoder, conversations_path: str, lines: list[tuple[int, str]], max_seq_len: int
) -> EncodedChunk:
    """Parse, encode, truncate, quarantine and serialize a chunk of (1-based line, text) of the prepare output."""
    import numpy as np

    convs = [parse_conversation(conversations_path, line_no, line) for line_no, line in lines]
    results = encoder.encode([conv["messages"] for conv in convs], [conv.get("tools") for conv in convs])
    # A row whose text writes a vision placeholder would stop the engine, on the GPU: quarantined here instead.
    results = refuse_media_in_text(encoder, convs, results, max_seq_len)
    rows: list[tuple[str, int] | Quarantined] = []
    masked: list[int] = []  # the loss-masked token ids of the chunk's kept rows, counted once at the end
    n_truncated = truncated_tokens = trailing_user = 0
    image_rows = n_images = image_tokens = 0
    for (line_no, _), conv, result in zip(lines, convs, results, strict=True):
        if isinstance(result, Rejected):
            rows.append(Quarantined(conversations_path, line_no, result.reason, result.detail, conv))
            continue
        ids, mask, *images = result  # a row with images also has its image record (tokenize.vision)
        full_len = len(ids)
        if images and full_len > max_seq_len:
            cut = cut_images(ids, images[0], max_seq_len, encoder)
            if isinstance(cut, str):
                rows.append(Quarantined(conversations_path, line_no, "image_cut_by_max_seq_len", cut, conv))
                continue
            images = [cut]
        if full_len > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        runs = mask_runs(mask)
        if not runs:
            where = f" within the first {max_seq_len} of {full_len} tokens" if full_len > max_seq_len else ""
            rows.append(
                Quarantined(
                    conversations_path, line_no, "no_assistant_tokens",
                    f"no assistant token{where} after applying the chat template", conv,
                )
            )  # fmt: skip
            continue
        n_truncated += full_len > max_seq_len
        trailing_user += conv["messages"][-1]["role"] == "user"
        truncated_tokens += max(full_len - max_seq_len, 0)
        for start, end in runs:
            masked += ids[start:end]
        tail = row_json_tail(conv["id"], ids, runs, encoder.id_str)
        if images:  # after seq_len, so that text rows keep their bytes
            image_rows += 1
            n_images += len(images[0]["images"])
            image_tokens += ids.count(encoder._vision.image_token_id)
            extra = json.dumps(images[0], ensure_ascii=False, separators=(",", ":"))
            tail = tail[: -len("}\n")] + "," + extra[1:] + "\n"
        rows.append((tail, len(ids)))
    # One bincount instead of a Counter.update per row: half the time (Counter hashes every token).
    counts = np.bincount(np.fromiter(masked, dtype=np.int64, count=len(masked)))
    distinct = np.flatnonzero(counts)
    return EncodedChunk(
        rows, (distinct, counts[distinct]), n_truncated, truncated_tokens, (image_rows, n_images, image_tokens),
        trailing_user,
    )  # fmt: skip


def parse_conversation(path: str, line_no: int, line: str) -> dict[str, Any]:
    """The Conversation JSON of one line of the prepare stage's output."""
    try:
        conv = json.loads(line)
        ok = isinstance(conv["id"], str) and all(
            isinstance(m["role"], str) and (isinstance(m["content"], str) or _parts_ok(m["content"]))
            for m in conv["messages"]
        )
    except (json.JSONDecodeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise TokenizeError(
            f"{path}:{line_no}: not a normalized conversation ({{id, messages: [{{role, content}}], source}}); "
            "re-run the prepare stage"
        )
    return conv


def _parts_ok(content: Any) -> bool:
    """Whether message content is prepare's list of text and image parts."""
    return isinstance(content, list) and all(
        isinstance(p, dict)
        and (
            (p.get("type") == "text" and isinstance(p.get("text"), str))
            or (p.get("type") == "image" and isinstance(p.get("image"), str) and isinstance(p.get("sha256"), str))
        )
        for p in content
    )


def cut_images(ids: list[int], record: dict[str, Any], max_seq_len: int, encoder) -> dict[str, Any] | str:
    """The image record of a row cut to max_seq_len (the images wholly inside it), or why the cut is refused:
    it falls inside an image's vision tokens (a partial image is nothing the target is ever served)."""
    image_id = encoder._vision.image_token_id
    runs, start = [], None
    for i, token in enumerate(ids):
        if token == image_id and start is None:
            start = i
        elif token != image_id and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    for k, (s, e) in enumerate(runs):
        # the image with the <|vision_start|> / <|vision_end|> around it: a cut between them and the image too
        if s - 1 < max_seq_len < e + 1:
            return (
                f"max_seq_len {max_seq_len} falls inside image {k} (its vision tokens {s}..{e - 1} of "
                f"{len(ids)}); raise tokenize.max_seq_len or shorten the conversation"
            )
    keep = sum(e + 1 <= max_seq_len for _, e in runs)
    return {"images": record["images"][:keep], "image_grid_thw": record["image_grid_thw"][:keep]}
