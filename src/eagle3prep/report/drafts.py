"""The report's "Drafts this dataset serves" section: for each draft type speculators trains, the layers its
view reads (eagle3prep.drafts: --target-layer-ids, then N) and whether the dataset holds them, with the bytes a
token of it reads in the shards' storage.

From the dataset alone (its layer ids, depth, storage), as the rest of the report: the report takes no config.
The drafts named in layers.drafts are shown by `snakemake -n` and `plan`; here each type is shown with
speculators' default layers, and the captured auxiliary layers any draft may choose from.
"""

from __future__ import annotations

import html
from typing import Any

from ..drafts import ALGORITHMS, draft_table, resolve_drafts
from ..shard.formats import storage_format, storage_of_entry
from .tables import table


def served(dataset: dict[str, Any]) -> list[dict[str, Any]]:
    """One row a draft type: its default view, held or not, and what a token of it reads (bytes)."""
    n, held = dataset["num_hidden_layers"], set(dataset["layer_ids"])
    storage = storage_format(storage_of_entry(dataset.get("storage")))
    per_layer = storage.token_bytes(dataset["hidden_size"], dataset["dtype"])
    defaults = resolve_drafts([{"type": kind} for kind in ALGORITHMS], n)
    return [
        {**row, "held": set(row["reads"]) <= held, "missing": sorted(set(row["reads"]) - held)}
        for row in draft_table(defaults, per_layer, dataset["tokens"])
    ]


def drafts_section(dataset: dict[str, Any]) -> list[str]:
    """The section's HTML parts."""
    n, ids = dataset["num_hidden_layers"], dataset["layer_ids"]
    if not ids or ids[-1] != n:
        return [f"<h2>Drafts this dataset serves</h2><p>None: the layers {html.escape(str(ids))} lack the pre-norm "
                f"final state (id {n}) that every speculators draft reads last.</p>"]  # fmt: skip
    body = [
        [r["type"], str(r["reads"]), "yes" if r["held"] else f"no: {r['missing']} not captured",
         f"{r['bytes_per_token']:,}", f"{r['bytes'] / 1e9:.3f}"]
        for r in served(dataset)
    ]  # fmt: skip
    aux = [i for i in ids if i != n]
    return [
        "<h2>Drafts this dataset serves</h2>",
        f"<p>Captured once: layers {html.escape(str(ids))} (input_of_layer = vLLM's and speculators' numbering). "
        "A draft of any type trains from this dataset when its <code>--target-layer-ids</code> are among the "
        f"auxiliary layers {html.escape(str(aux))} (mtp reads the final state {n} alone), through "
        "<code>eagle3prep-train -- --hidden-states-backend eagle3prep</code>, which reads only that draft's layer "
        "files. Below: each type with speculators' default layers.</p>",
        table(["type", "reads (default)", "held", "bytes / token", "GB read"], body, text=(0, 1, 2)),
    ]
