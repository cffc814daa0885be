"""Draft-model speculative decoding on meshlm's engine against the serving planner's `--draft-model`, as JSON.

    meshlm plan calibrate --out plan_calibration.json     # this machine, once (seconds)
    python benchmarks/speculative_planner.py --calibration plan_calibration.json

One process, one thread, a random Llama built from meshlm's own `ModelConfig` (no download, no tokenizer: token ids),
and its draft: the target's own embeddings, first --draft-layers decoder layers, final norm and head (an early exit of
the target, so it shares the vocabulary and agrees with it now and then). Each run serves --input-len prompt tokens
and --output-len new tokens (greedy, ignore_eos), plainly and with the draft proposing --draft-tokens tokens a step
(`Engine(speculative={"method": "draft"}, draft_model=...)`):
  single   one request at a time (--repeats of them; the fastest counts, timeit's rule): time to first token and the
           mean time between its later tokens, by engine step (`_common.stepped_generate`);
  batch    --batch requests submitted at once (a static batch): output tokens/s, mean TTFT and TPOT.
`acceptance` is the engine's own count (drafts accepted over steps that verified some), and the per-draft chain
acceptance p it implies (accepted per step = p + p^2 + ... + p^k) is what the planner is given: `meshlm plan infer
--cluster local --engine meshlm --mtp-tokens k --mtp-acceptance p --draft-model ...`'s prediction of the same runs
(fp32, the engine's host time as `plan calibrate` measured it), predicted / measured (`ratio`), where --calibration
names a calibration file; skipped otherwise. The question it answers: does the planner price what the draft adds to
a step -- its k forwards, its weights, the verification's k + 1 query tokens -- as the engine spends it? (The
acceptance itself is an input, measured here, not predicted.) meshlm's engine, like vLLM (and the planner), runs the
draft over a new prompt in the step that prefills it: the draft's prefill is in the TTFT.
benchmarks/speculative.py is the engine's own benchmark of speculation (trained models, transformers' assisted
generation beside it); this one checks the planner against the engine.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

import torch

from _common import (local_cluster_json, meshlm_on_this_machine, parse_args_smoke, print_result, single_and_batch,
                     static_batches_vs, stepped_generate)


def configs(args):
    """The target's and the draft's `ModelConfig`: the draft is the target cut to --draft-layers layers."""
    from meshlm.config import ModelConfig

    target = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                         num_heads=max(1, args.hidden // 32), num_kv_heads=max(1, args.hidden // 64),
                         intermediate_size=3 * args.hidden, max_seq_len=args.input_len + args.output_len + 16)
    return target, replace(target, num_layers=args.draft_layers)


def early_exit(target, cfg):
    """The draft: a model of `cfg` holding the target's embeddings, first layers, final norm and head."""
    from meshlm.models.transformer import Transformer

    draft = Transformer(cfg).eval()
    keep = {f"layers.{i}." for i in range(cfg.num_layers)}
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("layers.") or any(k.startswith(p) for p in keep)}
    draft.load_state_dict(state)
    return draft


def measure(engine, rng: random.Random, args) -> dict:
    """The single and batch runs of one engine (module docstring), and what its proposals achieved."""
    fresh = lambda: [rng.randrange(2, args.vocab) for _ in range(args.input_len)]  # noqa: E731
    stepped_generate(engine, [fresh()], 2)  # warm: the first prompt of a length pays one-time costs
    before = dict(vars(engine.spec_stats))
    runs = single_and_batch(engine, fresh, output_len=args.output_len, repeats=args.repeats, batch=args.batch)
    return {**runs, "spec_stats": {k: v - before[k] for k, v in vars(engine.spec_stats).items()}}


def chain_acceptance(accepted_per_step: float, k: int) -> float:
    """p with p + p^2 + ... + p^k = `accepted_per_step` (bisection), below 1 as the planner takes it."""
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, k + 1)) < accepted_per_step else (lo, mid)
    return round(lo, 4)


def planner(target_cfg, draft_cfg, calibration: str | None, runs: dict, args, budget: int) -> dict:
    """The planner's static batches of 1 and of --batch, plain and with the draft at the measured acceptance,
    predicted / measured; and the draft's slowdown or speedup of each, predicted against measured."""
    from meshlm.planner.serving_model import served_model
    from meshlm.planner.serving_workload import Workload

    plain, skipped = meshlm_on_this_machine(target_cfg, calibration)
    if plain is None:
        return skipped
    p = runs["draft"]["acceptance"]["chain_p"]
    spec = replace(plain, mtp_tokens=args.draft_tokens, mtp_acceptance=p, draft_model=served_model(draft_cfg))
    out = {"chain_p": p}
    priced = lambda b: Workload(args.input_len, args.output_len, batch=b, prefill_chunk=budget)  # noqa: E731
    for name, sv in (("plain", plain), ("draft", spec)):
        out[name] = static_batches_vs(sv, {p: runs[name][p] for p in ("single", "batch")}, priced)
    # what the draft does to each: TPOT with it over TPOT without
    over = lambda part, key: round(out["draft"][part]["tpot_ms"][key] / out["plain"][part]["tpot_ms"][key], 3)  # noqa: E731
    out["draft_over_plain_tpot"] = {part: {key: over(part, key) for key in ("measured", "predicted")}
                                    for part in ("single", "batch")}
    return {"cluster": local_cluster_json(plain.cluster), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--hidden", 256), ("--layers", 4), ("--draft-layers", 1), ("--vocab", 1024),
                          ("--input-len", 256), ("--output-len", 32), ("--draft-tokens", 3), ("--batch", 8),
                          ("--repeats", 3), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--calibration", default=None, help="a `meshlm plan calibrate` file: the planner's prediction")
    args = parse_args_smoke(ap, dict(hidden=64, layers=2, draft_layers=1, vocab=128, input_len=32, output_len=4,
                                     draft_tokens=2, batch=2, repeats=1))
    from meshlm.infer.engine import Engine
    from meshlm.models.transformer import Transformer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target_cfg, draft_cfg = configs(args)
    target = Transformer(target_cfg).eval()
    draft = early_exit(target, draft_cfg)
    budget = args.batch * args.input_len  # a static batch: every prompt prefilled in one step
    started = time.perf_counter()
    runs = {}
    for name, kw in (("plain", {}),
                     ("draft", dict(draft_model=draft, speculative={"method": "draft", "model": "early exit",
                                                                    "num_speculative_tokens": args.draft_tokens}))):
        engine = Engine(target, max_num_seqs=max(8, args.batch), max_num_batched_tokens=budget, **kw)
        runs[name] = measure(engine, rng, args)
    stats = runs["draft"]["spec_stats"]
    per_step = stats["accepted"] / stats["forwards"] if stats["forwards"] else 0.0
    runs["draft"]["acceptance"] = {"accepted_per_step": round(per_step, 4),
                                   "chain_p": chain_acceptance(per_step, args.draft_tokens)}
    result = {"model": {"hidden": args.hidden, "layers": args.layers, "draft_layers": args.draft_layers,
                        "vocab": args.vocab, "device": "cpu", "torch_threads": torch.get_num_threads()},
              "input_len": args.input_len, "output_len": args.output_len, "draft_tokens": args.draft_tokens,
              "runs": runs, "planner": planner(target_cfg, draft_cfg, args.calibration, runs, args, budget)}
    print_result(result, args, started)


if __name__ == "__main__":
    main()
