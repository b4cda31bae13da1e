"""bench_extract's closing report: the tokens/s table with the ratios b/a, b/c, b/d, the model-FLOP
utilisation, (b)'s bytes, host RSS and writer waits, whether the disk is the limit, and the engine starts."""

from __future__ import annotations

import time

from extractbench.disk import disk_cost
from extractbench.workload import PEAK_TFLOPS, flops_per_token, layer_ids

from testkit.rounds import round_ratios


def print_report(args, results: dict, disk_before: tuple, disk_after: tuple, streams: int) -> None:
    """Every part of the report in order, from the phases' results and the disk speeds measured before
    and after them (one file, then `streams` files at once)."""
    print_table(args, results)
    if args.images:
        print_images(args)
    b = results.get("b")
    if b and "uniform_shm" in b:
        print_shm_row(results, b)
    if b:
        print_phase_b(args, b)
        print_disk(results, b, disk_before, disk_after, streams)
        print_writers(b)
    print_builtin(results, args.scaled)
    if "b" not in results and any(p in results for p in "fg"):
        print_disk_builtin(results, disk_before, disk_after, streams)
    for p in "abcdefgp":
        if p in results:
            print(f"engine start ({p}): {results[p]['engine_start_s']:.1f} s")
    if b:
        print_shard_size(b)


def print_images(args) -> None:
    """--images: what the workloads hold, from tokenize's stats.json (rows, images, vision tokens' share)."""
    import json

    for w in ("uniform", "mixed"):
        st = json.loads((args.out / f"work_{w}" / "tok" / "stats.json").read_text())
        print(
            f"(images) {w}: {st['rows']} rows, {st['tokens']:,} tokens, {st.get('image_rows', 0)} rows with "
            f"{st.get('images', 0)} images, {st.get('image_tokens', 0):,} vision tokens "
            f"({100 * st.get('image_token_share', 0):.1f} % of the tokens)"
        )


def print_builtin(results: dict, scaled: str = "fp8_e4m3") -> None:
    """(f) and (g), the built-in path through our connector (compiled; g: `scaled` storage), against (p), (a) and (b): the
    targets are f/p and g/p >= 0.95 (f/a where (p) did not run), g at half f's bytes, RSS growth after the
    first shard < 64 MiB. (e) splits f's gap to (p): e/p is vLLM's method alone, f/e what our connector adds."""
    for w in ("uniform", "mixed"):
        if "p" in results:
            print(f"(p) vLLM prefill, compiled {w}: {results['p'][w]['tokens_per_s']:,.0f} tok/s")
        if "e" in results:  # vLLM's extract_hidden_states alone: how much of f's gap is vLLM's own
            e = results["e"][w]["tokens_per_s"]
            line = [f"(e) extract_hidden_states, nothing saved, compiled {w}: {e:,.0f} tok/s"]
            line += [f"e/p {e / results['p'][w]['tokens_per_s']:.2f}"] if "p" in results else []
            line += [f"f/e {results['f'][w]['tokens_per_s'] / e:.2f}"] if "f" in results else []
            print(", ".join(line))
    for p, what in (("f", "built-in, compiled"), ("g", f"built-in, compiled, {scaled}")):
        r = results.get(p)
        if not r:
            continue
        for w in ("uniform", "mixed"):
            parts = [f"({p}) {what} {w}: {r[w]['tokens_per_s']:,.0f} tok/s"]
            parts += [
                f"{p}/{q} {r[w]['tokens_per_s'] / results[q][w]['tokens_per_s']:.2f}" for q in "pab" if q in results
            ]
            parts.append(
                f"writes {r[w]['bytes_per_s'] / 1e9:.2f} GB/s ({r[w]['bytes'] / r[w]['tokens']:,.0f} B/token)"
            )
            print(", ".join(parts))
        if "uniform_lp" in r:  # the same shard with the scalable reference's logits-check rows: what they cost
            lp = r["uniform_lp"]["tokens_per_s"]
            print(
                f"({p}) uniform with the scalable reference's logits-check rows: {lp:,.0f} tok/s"
                + "".join(f", {p}/{q} {lp / results[q]['uniform']['tokens_per_s']:.2f}" for q in "pa" if q in results)
                + f"; the rows cost {1 - lp / r['uniform']['tokens_per_s']:.1%}"
            )
        again = f", {r['mixed_again']['rss_growth_mib']:.0f} MiB (mixed again)" if "mixed_again" in r else ""
        print(
            f"({p}) host RSS growth: first (half) shard {r['uniform_half']['rss_growth_mib']:.0f} MiB, then "
            f"{r['uniform']['rss_growth_mib']:.0f} MiB (full) and {r['mixed']['rss_growth_mib']:.0f} MiB (mixed)"
            f"{again}; "
            f"peak RSS {r['peak_rss_mib']:.0f} MiB; capture path {r['capture_path']}; engine start "
            f"{r['engine_start_s']:.1f} s; worker writer, seconds: {r['uniform'].get('writer')}"
        )
        tails = {
            w: {k: (v.get("writer") or {}).get(k) for k in TAIL_KEYS} for w, v in r.items() if isinstance(v, dict)
        }
        print(f"({p}) the shards' tails after their last engine step, seconds: {tails}")
        for w in ("uniform", "mixed"):  # the same shard's time in engine steps, beside (p)'s whole time
            secs = r[w]["tokens"] / r[w]["tokens_per_s"]
            line = (
                f"({p}) {w}: {secs:.2f} s, of which engine steps {(r[w].get('writer') or {}).get('driver_step_s')} s"
            )
            if "p" in results:
                line += f"; (p) {results['p'][w]['tokens'] / results['p'][w]['tokens_per_s']:.2f} s"
            print(line)


# Where a shard's time outside the engine's steps went (vllm/capture/loop.py: the driver's clock)
TAIL_KEYS = ("open_s", "driver_add_s", "drain_s", "drain_steps", "finish_s")


def print_table(args, results: dict) -> None:
    """The header line, the tokens/s of each phase per workload with (b)'s ratios, and (a)'s MFU."""
    import torch

    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    shape = args.shape
    print(
        f"\n# {time.strftime('%Y-%m-%d')} {dev}, torch {torch.__version__}, "
        f"vLLM {next((results[p]['vllm'] for p in 'bfg' if p in results), '?')}, shape {shape}, dtype {args.dtype}, eager, layers {layer_ids(shape)}"
        + (f", Qwen2.5-VL vision tower {args.vision}" if args.images else "")
    )
    print(
        "| workload | (a) vLLM prefill | (b) eagle3prep vllm | (c) transformers | (d) vLLM connector | b/a | b/c | b/d |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for w in ("uniform", "mixed"):
        v = {p: results.get(p, {}).get(w, {}).get("tokens_per_s") for p in "abcd"}

        def ratio(x, y):
            return f"{x / y:.2f}" if x and y else "-"

        print(
            f"| {w} ({results.get('b', results.get('a', {})).get(w, {}).get('tokens', '?')} tok) | "
            + " | ".join(f"{v[p]:,.0f}" if v[p] else "-" for p in "abcd")
            + f" | {ratio(v['b'], v['a'])} | {ratio(v['b'], v['c'])} | {ratio(v['b'], v['d'])} |"
        )
    for p, w, seq in (("a", "uniform", args.seq), ("a", "mixed", (args.min_len + args.max_len) / 2)):
        if p in results and not args.images:  # images: the vision tower's FLOPs are not counted here
            tflops = results[p][w]["tokens_per_s"] * flops_per_token(shape, seq) / 1e12
            print(f"({p}) {w}: {tflops:.0f} TFLOP/s = {100 * tflops / PEAK_TFLOPS:.0f} % MFU of {PEAK_TFLOPS:.0f}")


def print_shm_row(results: dict, b: dict) -> None:
    """The table's row of (b) writing its uniform shard to /dev/shm: the like-for-like with (d)."""
    v = {p: results.get(p, {}).get("uniform", {}).get("tokens_per_s") for p in "acd"}
    shm_rate = b["uniform_shm"]["tokens_per_s"]
    print(
        f"| uniform, (b) to /dev/shm | {v['a'] or 0:,.0f} | {shm_rate:,.0f} | {v['c'] or 0:,.0f} | {v['d'] or 0:,.0f} | "
        + " | ".join(f"{shm_rate / v[p]:.2f}" if v[p] else "-" for p in "acd")
        + " |"
    )


def print_phase_b(args, b: dict) -> None:
    """(b)'s MFU, write rate and host RSS growth per workload; RSS must not grow with the shard."""
    shape = args.shape
    for w, seq in (("uniform", args.seq), ("mixed", (args.min_len + args.max_len) / 2)):
        if args.images:  # the vision tower's FLOPs are not counted by flops_per_token
            print(
                f"(b) {w}: writes {b[w]['bytes_per_s'] / 1e9:.2f} GB/s; host RSS growth {b[w]['rss_growth_mib']:.0f} MiB"
            )
            continue
        tflops = b[w]["tokens_per_s"] * flops_per_token(shape, seq) / 1e12
        print(
            f"(b) {w}: {tflops:.0f} TFLOP/s = {100 * tflops / PEAK_TFLOPS:.0f} % MFU of {PEAK_TFLOPS:.0f}; "
            f"writes {b[w]['bytes_per_s'] / 1e9:.2f} GB/s; host RSS growth during the shard "
            f"{b[w]['rss_growth_mib']:.0f} MiB"
        )
    print(
        f"(b) host RSS growth: half shard {b['uniform_half']['rss_growth_mib']:.0f} MiB "
        f"({b['uniform_half']['tokens']} tok), full shard {b['uniform']['rss_growth_mib']:.0f} MiB "
        f"({b['uniform']['tokens']} tok); peak RSS of the capture process {b['peak_rss_mib']:.0f} MiB; "
        f"capture path {b['capture_path']}"
    )


def print_disk_builtin(results: dict, disk_before: tuple, disk_after: tuple, streams: int) -> None:
    """The disk's own write speed beside what (f) and (g) wrote, and the rate it would cap each at: where the
    disk, not the capture, keeps a built-in shard under (p)."""
    best = max(*disk_before, *disk_after)
    print(
        f"disk write + fsync, same folder, before / after the phases: {disk_before[0] / 1e9:.2f} / "
        f"{disk_after[0] / 1e9:.2f} GB/s one file, {disk_before[1] / 1e9:.2f} / {disk_after[1] / 1e9:.2f} GB/s "
        f"{streams} files at once"
    )
    base = results.get("p") or results.get("a")
    for p in "fg":
        if p not in results:
            continue
        r = results[p]["uniform"]
        cap = best / (r["bytes"] / r["tokens"])
        line = f"({p}) wrote {r['bytes_per_s'] / 1e9:.2f} GB/s ({100 * r['bytes_per_s'] / best:.0f} % of the disk's fastest)"
        line += f"; the disk alone would cap it at {cap:,.0f} tok/s" + (
            f" = {cap / base['uniform']['tokens_per_s']:.2f} x (p)" if base else ""
        )
        print(line)


def print_disk(results: dict, b: dict, disk_before: tuple, disk_after: tuple, streams: int) -> None:
    """The disk's speeds against what (b) wrote and what (a)'s rate would need, then what the disk costs
    (b) against /dev/shm: whether the disk or the capture keeps (b) under 0.95 x (a)."""
    disk, disk_par = max(disk_before[0], disk_after[0]), max(disk_before[1], disk_after[1])
    per_token = b["uniform"]["bytes"] / b["uniform"]["tokens"]
    need = results["a"]["uniform"]["tokens_per_s"] * per_token if "a" in results else None
    best = max(disk, disk_par)
    print(
        f"disk write + fsync, same folder, before / after the phases: {disk_before[0] / 1e9:.2f} / "
        f"{disk_after[0] / 1e9:.2f} GB/s one file, {disk_before[1] / 1e9:.2f} / {disk_after[1] / 1e9:.2f} GB/s "
        f"{streams} files at once; (b) wrote {b['uniform']['bytes_per_s'] / 1e9:.2f} GB/s "
        f"({100 * b['uniform']['bytes_per_s'] / best:.0f} % of the fastest)"
        + (
            f"; at (a)'s rate the shard needs {need / 1e9:.2f} GB/s -> "
            + (
                f"the disk is the limit: it caps (b) at {best / per_token:,.0f} tok/s = "
                f"{best / per_token / results['a']['uniform']['tokens_per_s']:.2f} x (a)"
                if need > 0.95 * best
                else "the disk is not the limit"
            )
            if need
            else ""
        )
    )
    if "uniform_shm" in b:  # what writing to the disk costs a shard: a steady rate, or a tail?
        print(f"(b) uniform: {disk_cost(b)}")
        a_rate = results.get("a", {}).get("uniform", {}).get("tokens_per_s")
        if a_rate:
            shm_ratio, disk_ratio = (
                b["uniform_shm"]["tokens_per_s"] / a_rate,
                b["uniform"]["tokens_per_s"] / a_rate,
            )
            print(
                f"(b) uniform b/a: {disk_ratio:.2f} to disk, {shm_ratio:.2f} to /dev/shm -> "
                + (
                    "the disk is what keeps (b) under 0.95 x (a) on this shard"
                    if shm_ratio >= 0.95 > disk_ratio
                    else "the capture itself, not only the disk, keeps (b) under 0.95 x (a)"
                    if shm_ratio < 0.95
                    else "at or above 0.95 x (a) to disk"
                )
            )


def print_writers(b: dict) -> None:
    """The worker's writer seconds per workload and (b)'s engine start, split into LLM() and smoke capture."""
    for w in ("uniform_half", "uniform", "mixed", "uniform_shm"):
        if b.get(w, {}).get("writer"):
            print(f"(b) {w} worker writer, seconds: {b[w]['writer']}")
    print(
        f"(b) engine start {b['engine_start_s']:.1f} s = LLM() {b['engine_init_s']} s + smoke capture {b['smoke_s']} s + rest"
    )


def print_shard_size(b: dict) -> None:
    """The shard size at which (b)'s engine start stays under plan's START_SHARE of a job."""
    from eagle3prep.plan.estimate import START_SHARE, min_tokens_per_shard

    rate, start = b["uniform"]["tokens_per_s"], b["engine_start_s"]
    print(
        f"shard size that keeps (b)'s engine start under {100 * START_SHARE:.0f} % of a job: "
        f">= {min_tokens_per_shard(rate, start):,} tokens ({start:.0f} s start at {rate:,.0f} tok/s)"
    )


def print_rounds(rounds: list[dict]) -> None:
    print(f"over {len(rounds)} rounds, each against its own round's (a):")
    for line in round_ratios(rounds):
        print("  " + line)
