"""KV cache tiers benchmark: a multi-turn chat trace whose prefixes outgrow the device KV pool, with and without
the host and disk tiers, printed as one JSON.

    python benchmarks/kv_tiers.py                    # CPU, about a minute on 2 cores
    python benchmarks/kv_tiers.py --conversations 16 --turns 6 --hidden 512 --layers 8

The trace: --conversations chats sharing a system prompt (--system-len tokens), each with its own opening
(--opening-len), then --turns turns; a turn's prompt is the conversation so far (earlier prompts and the model's
replies) plus --user-len new tokens, and the model replies with --reply-len tokens (greedy). Turns go round the
conversations one request at a time, as chat clients waiting for each answer send them. The device pool holds a
quarter of the trace's working set (--pool-fraction: the KV blocks of every conversation's final length), so a
conversation's prefix is evicted before its next turn.

Runs, on the same trace and model (a random meshlm Llama, fp32, one intra-op thread):
  device_only   no tiers: an evicted prefix is recomputed
  host          --kv-host-mb sized to hold the whole working set
  host_disk     a host tier of a quarter of the working set (--host-fraction), the rest on disk (--kv-disk-dir in a
                temporary directory)
  disk_restart  a new LLM on host_disk's directory: what a restarted server finds on disk
For each: prompt tokens found per tier (hit rate = tokens / prompt tokens), prompt tokens recomputed, time to first
token p50/p99 (one request at a time: its prefill, tier copies included), wall time, the tiers' memory (host buffer
allocated, disk files) and the process's resident memory after the run, and whether the tokens equal device_only's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import parse_args_smoke


def trace(args) -> list[tuple[int, list[int]]]:
    """(conversation, new tokens of its user turn) in arrival order; the prompt also holds the replies so far."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.turns):
        for c in range(args.conversations):
            out.append((c, [rng.randrange(1, args.vocab) for _ in range(args.user_len)]))
    return out


def openings(args) -> list[list[int]]:
    rng = random.Random(args.seed + 1)
    system = [rng.randrange(1, args.vocab) for _ in range(args.system_len)]
    return [system + [rng.randrange(1, args.vocab) for _ in range(args.opening_len)] for _ in range(args.conversations)]


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_trace(model, args, num_blocks: int, **tiers) -> dict:
    """The whole trace through one `LLM`: its replies, TTFTs and the engine's counters."""
    from meshlm import LLM, SamplingParams

    llm = LLM(model, device="cpu", block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=4, **tiers)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_len, ignore_eos=True)
    convs = openings(args)
    replies, ttfts = [], []
    start = time.perf_counter()
    for c, user in trace(args):
        convs[c] += user
        seq = engine.add_request(list(convs[c]), params)
        while not seq.is_finished:
            engine.step()
        ttfts.append(seq.first_token_time - seq.arrival_time)
        convs[c] += seq.output_token_ids
        replies.append(list(seq.output_token_ids))
    wall = time.perf_counter() - start
    s = engine.stats()
    store = engine.runner.tier_store
    prompt = s["prefix_cache_queried_tokens"]
    return {
        "replies": replies,
        "result": {
            "prompt_tokens": prompt,
            "hit_rate": {tier: s[f"kv_{tier}_hit_tokens"] / prompt for tier in ("device", "host", "disk")},
            "hit_tokens": {tier: s[f"kv_{tier}_hit_tokens"] for tier in ("device", "host", "disk")},
            "recomputed_tokens": s["kv_recomputed_tokens"],
            "ttft_ms": {"p50": 1e3 * percentile(ttfts, 0.5), "p99": 1e3 * percentile(ttfts, 0.99),
                        "mean": 1e3 * statistics.fmean(ttfts)},
            "wall_s": wall, "kv_tier_seconds": engine.seconds["kv_tiers"],
            "blocks_moved": {k: s[f"kv_{k}"] for k in ("host_saved_blocks", "disk_saved_blocks", "host_loaded_blocks",
                                                       "disk_loaded_blocks", "disk_evicted_blocks", "dropped_blocks")},
            "memory_mb": {"device_pool": num_blocks * block_bytes(model, args.block_size) / 2 ** 20,
                          "host_tier": (store.host_bytes if store else 0) / 2 ** 20,
                          "disk_tier": (store.disk_bytes() if store else 0) / 2 ** 20,
                          "process_resident": resident_mb()},
        },
    }


def block_bytes(model, block_size: int) -> int:
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4  # fp32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=64, help="tokens of the shared system prompt (default 64)")
    ap.add_argument("--opening-len", type=int, default=96, help="each conversation's first tokens (default 96)")
    ap.add_argument("--user-len", type=int, default=24, help="new tokens of a user turn (default 24)")
    ap.add_argument("--reply-len", type=int, default=16, help="tokens of a reply (default 16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-fraction", type=float, default=0.25,
                    help="device pool / working set (default 0.25: the working set is 4x the pool)")
    ap.add_argument("--host-fraction", type=float, default=0.25,
                    help="host_disk's host tier / working set (default 0.25; the disk holds it all)")
    ap.add_argument("--seed", type=int, default=0)
    # --smoke: a 1-layer model of hidden 64, 4 conversations of 3 turns, blocks of 8 tokens
    args = parse_args_smoke(ap, dict(hidden=64, layers=1, vocab=128, conversations=4, turns=3, system_len=16,
                                     opening_len=16, user_len=8, reply_len=4, block_size=8))
    torch.set_num_threads(1)
    from meshlm.config import ModelConfig
    from meshlm.models import build_model

    final_len = args.system_len + args.opening_len + args.turns * (args.user_len + args.reply_len)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=max(2, args.hidden // 32), num_kv_heads=max(1, args.hidden // 128),
                      intermediate_size=3 * args.hidden, max_seq_len=final_len + args.block_size)
    model = build_model(cfg, seed=args.seed)
    working_set = args.conversations * -(-final_len // args.block_size)  # blocks
    pool = max(-(-final_len // args.block_size) + 1, int(working_set * args.pool_fraction))
    mb = block_bytes(model, args.block_size) / 2 ** 20
    runs = {}
    base = run_trace(model, args, pool)
    runs["device_only"] = base["result"]
    runs["host"] = run_trace(model, args, pool, kv_host_mb=working_set * mb * 1.01)
    with tempfile.TemporaryDirectory() as disk_dir:
        disk = dict(kv_host_mb=working_set * args.host_fraction * mb * 1.01, kv_disk_dir=disk_dir,
                    kv_disk_mb=working_set * (mb + 0.001) * 1.01)
        runs["host_disk"] = run_trace(model, args, pool, **disk)
        runs["disk_restart"] = run_trace(model, args, pool, **disk)
    for name in ("host", "host_disk", "disk_restart"):
        result = runs[name]
        runs[name] = result["result"]
        runs[name]["tokens_equal_device_only"] = result["replies"] == base["replies"]
    out = {"benchmark": "kv_tiers", "smoke": args.smoke,
           "config": {k: v for k, v in vars(args).items() if k != "smoke"},
           "requests": args.conversations * args.turns, "working_set_blocks": working_set, "device_pool_blocks": pool,
           "block_mb": mb, "runs": runs}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
