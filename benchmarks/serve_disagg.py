"""Disaggregated prefill/decode against colocated serving on the same ranks, under a mixed load; one JSON.

    python benchmarks/serve_disagg.py                        # 2 ranks, CPU, a few minutes
    python benchmarks/serve_disagg.py --long-len 1024 --long 6 --short 16 --rate 6

The load: --short requests of --short-len random tokens generating --short-out tokens each (the running decodes)
and, among them, --long requests of --long-len tokens generating --long-out (the long prompts that stall every
decode of a colocated engine while they prefill), shuffled and streamed at Poisson arrivals of --rate requests/s
(`serve.online_run`'s client: TTFT = request sent -> first streamed text, TPOT = (last chunk - first chunk) /
(tokens - 1)). Both deployments use --ranks ranks (one intra-op thread each) of a tiny random Llama on CPU behind
one HTTP endpoint:
  colocated       `meshlm serve --replicas R --router round_robin`: R engines, each prefilling and decoding;
  disaggregated   `meshlm serve --prefill tp=1 --decode tp=1` (with --ranks 2; more ranks: --prefill/--decode):
                  prompts prefilled on one instance, their KV sent to the other, which decodes.
Per deployment: TTFT and TPOT p50/p99 (all requests, and the short ones: the decodes the long prompts disturb),
output tokens/s and the mean number of requests in flight.
Beside them, the serving planner's prediction for the same deployments (`meshlm plan infer --cluster local
--calibration FILE --layout L [--disaggregate P:D]` at the measured mean concurrency, the mean input and output
lengths) when --calibration names a `meshlm plan calibrate` file (default plan_calibration.json, when present) and
both instances have the same layout L (the planner's pools share one); on `local` the planner prices fp32 weights
and KV and meshlm's engine (its host time per step from the calibration, where the file has it), as the run is.
Not here: prefill and decode on different emulated nodes (`meshlm cluster emulate`): `meshlm serve` does not
start ranks across nodes yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import missing_extras, parse_args_smoke, print_smoke_skip


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(results: list[dict], wall: float) -> dict:
    def figures(rs: list[dict]) -> dict:
        ttft, tpot = [r["ttft"] for r in rs], [r["tpot"] for r in rs]
        return {"requests": len(rs), "ttft_p50_ms": round(1e3 * statistics.median(ttft), 1),
                "ttft_p99_ms": round(1e3 * percentile(ttft, 0.99), 1),
                "tpot_p50_ms": round(1e3 * statistics.median(tpot), 2),
                "tpot_p99_ms": round(1e3 * percentile(tpot, 0.99), 2)}

    short = [r for r in results if not r["long"]]
    return {**figures(results), "short_requests": figures(short) if short else None,
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1),
            "mean_concurrency": round(sum(r["ttft"] + r["tpot"] * max(r["tokens"] - 1, 0) for r in results) / wall, 2),
            "wall_seconds": round(wall, 2)}


def run_load(url: str, trace: list[tuple[list[int], int, bool]], rate: float, seed: int) -> dict:
    """The trace streamed at Poisson arrivals through `url`; each request's TTFT, TPOT and tokens."""
    import httpx

    from serve import one_request

    async def go():
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await one_request(client, [1] * 8, 2)  # warm-up
            tasks = []
            t = time.perf_counter()
            for prompt, out_len, _ in trace:
                tasks.append(asyncio.create_task(one_request(client, prompt, out_len)))
                await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
            return results, time.perf_counter() - t

    results, wall = asyncio.run(go())
    for r, (_, _, long) in zip(results, trace):
        r["long"] = long
    return summary(results, wall)


def planner(path: Path, calibration: str | None, trace, measured: dict, *, prefill, decode) -> dict:
    """`meshlm plan infer` for both deployments on the calibrated local cluster."""
    if prefill != decode:
        return {"skipped": f"the planner's --disaggregate pools share one layout; here prefill {prefill.label()}, "
                           f"decode {decode.label()}"}
    if calibration is None or not Path(calibration).exists():
        return {"skipped": "no calibration file: run `meshlm plan calibrate --out plan_calibration.json` and pass "
                           "--calibration plan_calibration.json"}
    ins = round(statistics.mean(len(p) for p, _, _ in trace))
    outs = round(statistics.mean(o for _, o, _ in trace))
    out = {"input_len": ins, "output_len": outs, "precision": "fp32 (plan infer's default on --cluster local)"}
    for name, extra in (("colocated", ["--gpus", str(prefill.ranks + decode.ranks)]),
                        ("disaggregated", ["--disaggregate", f"{prefill.ranks}:{decode.ranks}"])):
        concurrency = max(1, round(measured[name]["mean_concurrency"]))
        argv = [sys.executable, "-m", "meshlm.cli", "plan", "infer", "--model", str(path), "--cluster", "local",
                "--calibration", calibration, "--layout", f"tp={prefill.tp},cp={prefill.cp}", "--input-len", str(ins), "--output-len", str(outs),
                "--concurrency", str(concurrency), "--json", *extra]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            out[name] = {"error": done.stderr.strip()[-500:]}
            continue
        r = json.loads(done.stdout)
        r = r[0] if isinstance(r, list) else r
        out[name] = {"concurrency": concurrency, **{k: round(r[k], 3) for k in
                                                    ("ttft_ms", "tpot_ms", "output_tokens_per_s") if k in r}}
        for k in ("ttft_ms", "tpot_ms", "output_tokens_per_s"):
            key = {"ttft_ms": "ttft_p50_ms", "tpot_ms": "tpot_p50_ms"}.get(k, k)
            if k in r and measured[name].get(key):
                out[name][f"measured_over_predicted_{k.removesuffix('_ms')}"] = float(f"{measured[name][key] / r[k]:.3g}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="ranks of each deployment (default 2)")
    ap.add_argument("--prefill", default="tp=1", help="the disaggregated prefill instance (default tp=1)")
    ap.add_argument("--decode", default="tp=1", help="the disaggregated decode instance (default tp=1)")
    ap.add_argument("--short", type=int, default=24, help="requests with short prompts (default 24)")
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--short-out", type=int, default=48)
    ap.add_argument("--long", type=int, default=8, help="requests with long prompts among them (default 8)")
    ap.add_argument("--long-len", type=int, default=768)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--rate", type=float, default=12.0, help="arrivals per second (Poisson; default 12)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="each engine's token budget per step: the chunk a long prompt is prefilled in (default 256)")
    ap.add_argument("--calibration", default="plan_calibration.json",
                    help="a `meshlm plan calibrate` file for the planner's prediction (skipped when absent)")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args_smoke(ap, dict(short=3, short_len=8, short_out=4, long=1, long_len=48, long_out=2, rate=50.0,
                                     hidden=32, layers=1, vocab=256, max_num_batched_tokens=32))
    if missing := missing_extras("transformers", "tokenizers", "fastapi", "uvicorn", "httpx"):
        print_smoke_skip("serve_disagg", {"everything": f"needs {', '.join(missing)} (pip install meshlm[hf,serve])"})
        return
    from meshlm.infer.instances import disaggregate_label, parse_instance
    from serve import make_model, meshlm_server

    prefill, decode = parse_instance(args.prefill, role="prefill"), parse_instance(args.decode, role="decode")
    if prefill.ranks + decode.ranks != args.ranks:
        raise SystemExit(f"--prefill {args.prefill} and --decode {args.decode} use {prefill.ranks + decode.ranks} "
                         f"ranks, --ranks is {args.ranks}")
    rng = random.Random(args.seed)
    started = time.perf_counter()
    result = {"benchmark": "serve_disagg", "ranks": args.ranks,
              "disaggregate": disaggregate_label(prefill, decode), "prefill": prefill.label(),
              "decode": decode.label(), "cpu_cores": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        max_len = max(args.long_len + args.long_out, args.short_len + args.short_out) + 16
        vocab = make_model(path, hidden=args.hidden, layers=args.layers, vocab=args.vocab, max_len=max_len)
        trace = [([rng.randrange(2, vocab) for _ in range(args.short_len)], args.short_out, False)
                 for _ in range(args.short)]
        trace += [([rng.randrange(2, vocab) for _ in range(args.long_len)], args.long_out, True)
                  for _ in range(args.long)]
        rng.shuffle(trace)
        result["model"] = {"hidden": args.hidden, "layers": args.layers, "vocab": vocab, "dtype": "float32"}
        result["load"] = {"short": [args.short, args.short_len, args.short_out],
                          "long": [args.long, args.long_len, args.long_out], "rate_per_s": args.rate,
                          "max_num_batched_tokens": args.max_num_batched_tokens}
        budget = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        deployments = {"colocated": ["--replicas", str(args.ranks), "--router", "round_robin", *budget],
                       "disaggregated": ["--prefill", args.prefill, "--decode", args.decode, *budget]}
        for name, flags in deployments.items():
            stopped = {}
            with meshlm_server(["--model", str(path), "--served-model-name", "bench", "--device", "cpu",
                                "--kv-cache-mb", "64", *flags], threads=1, timeout_s=600, stopped=stopped) as url:
                result[name] = run_load(url, trace, args.rate, args.seed)
            result[name]["server_stopped"] = stopped
        result["planner"] = planner(path, args.calibration, trace, result, prefill=prefill, decode=decode)
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    if args.smoke:
        result["smoke"] = True
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
