"""Prefix caching on meshlm's engine against the serving planner's `--prefix-hit`, printed as JSON.

    meshlm plan calibrate --out plan_calibration.json     # this machine, once (seconds)
    python benchmarks/prefix_cache.py --calibration plan_calibration.json

One process, one thread, a random Llama built from meshlm's own `ModelConfig` (no download, no tokenizer: token ids).
For each share H in --hits, requests of --input-len prompt tokens whose first H x input-len tokens (whole KV blocks)
an earlier request prefilled, so that the engine's prefix cache holds them, then --output-len new tokens each:
  single   one request at a time (--repeats of them, each with a prompt of its own past the shared prefix; the fastest
           counts, timeit's rule): time to first token from its submission, and the mean time between its later
           tokens, by engine step (`_common.stepped_generate`);
  batch    --batch such requests submitted at once, the engine's token budget large enough to prefill them in one
           step (a static batch): output tokens/s, mean TTFT and TPOT.
`hit_measured` is the engine's own count (prompt tokens found in its cache over those looked up) in those runs: the
share the planner is given. Beside each, `meshlm plan infer --cluster local --engine meshlm --prefix-hit H`'s
prediction of the same static batch (fp32, the engine's host time as `plan calibrate` measured it) as predicted /
measured (`ratio`), where --calibration names a calibration file; skipped otherwise. The question it answers: does
the planner's prefix-hit model -- the cached tokens not prefilled, the rest attending over the whole prompt, the
decode unchanged -- move the TTFT as the engine's cache does?
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from _common import (local_cluster_json, meshlm_on_this_machine, parse_args_smoke, print_result, single_and_batch,
                     static_batches_vs, stepped_generate)


def model_config(args):
    from meshlm.config import ModelConfig

    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=max(1, args.hidden // 32), num_kv_heads=max(1, args.hidden // 64),
                       intermediate_size=3 * args.hidden, max_seq_len=args.input_len + args.output_len + 16)


def at_hit(engine, rng: random.Random, args, hit: float) -> dict:
    """The single and batch runs at one hit share (module docstring)."""
    block, vocab = engine.block_manager.block_size, args.vocab
    cached = int(hit * args.input_len) // block * block
    prefix = [rng.randrange(2, vocab) for _ in range(cached)]
    fresh = lambda: prefix + [rng.randrange(2, vocab) for _ in range(args.input_len - cached)]  # noqa: E731
    stepped_generate(engine, [fresh()], 1)  # an earlier request: the prefix's blocks enter the cache
    before = engine.stats()
    runs = single_and_batch(engine, fresh, output_len=args.output_len, repeats=args.repeats, batch=args.batch)
    after = engine.stats()
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    found = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return {"hit_asked": hit, "cached_tokens": cached, "hit_measured": round(found / queried, 4) if queried else 0.0,
            **runs}


def planner(cfg, calibration: str | None, runs: list[dict], args, engine) -> dict:
    """The planner's static batches of 1 and of --batch at each run's measured hit share, predicted / measured."""
    from meshlm.planner.serving_workload import Workload

    sv, skipped = meshlm_on_this_machine(cfg, calibration)
    if sv is None:
        return skipped
    budget = engine.scheduler.max_num_batched_tokens
    out = []
    for run in runs:
        hit = run["hit_measured"]
        out.append({"hit": hit, **static_batches_vs(sv, {p: run[p] for p in ("single", "batch")}, lambda b: Workload(
            args.input_len, args.output_len, batch=b, prefill_chunk=budget, prefix_hit=hit))})
    cold = next((i for i, r in enumerate(runs) if r["hit_measured"] == 0), None)
    if cold is not None:  # each run's single-request TTFT over the uncached prompt's, measured and priced
        for row, run in zip(out, runs):
            row["single_ttft_over_cold"] = {
                "measured": round(run["single"]["ttft_ms"] / runs[cold]["single"]["ttft_ms"], 3),
                "predicted": round(row["single"]["ttft_ms"]["predicted"] / out[cold]["single"]["ttft_ms"]["predicted"],
                                   3)}
    return {"cluster": local_cluster_json(sv.cluster), "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--hidden", 256), ("--layers", 4), ("--vocab", 1024), ("--input-len", 1024),
                          ("--output-len", 8), ("--batch", 8), ("--repeats", 5), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--hits", default="0,0.5,0.875,0.96875", help="prompt shares cached (default 0,0.5,0.875,0.96875)")
    ap.add_argument("--calibration", default=None, help="a `meshlm plan calibrate` file: the planner's prediction")
    args = parse_args_smoke(ap, dict(hidden=64, layers=1, vocab=128, input_len=64, output_len=2, batch=2, repeats=1,
                                     hits="0,0.5"))
    from meshlm import LLM
    from meshlm.models.transformer import Transformer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = model_config(args)
    llm = LLM(Transformer(cfg).eval(), device="cpu", max_num_seqs=max(8, args.batch),
              max_num_batched_tokens=args.batch * args.input_len)
    engine = llm.engine
    started = time.perf_counter()
    stepped_generate(engine, [[rng.randrange(2, args.vocab) for _ in range(args.input_len)]], args.output_len)  # warm
    runs = [at_hit(engine, rng, args, float(h)) for h in args.hits.split(",")]
    result = {"model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "device": "cpu",
                        "torch_threads": torch.get_num_threads(), "block_size": engine.block_manager.block_size},
              "input_len": args.input_len, "output_len": args.output_len, "runs": runs,
              "planner": planner(cfg, args.calibration, runs, args, engine)}
    print_result(result, args, started)


if __name__ == "__main__":
    main()
