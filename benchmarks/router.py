"""Cache-aware routing against round robin over replicas of `meshlm serve`, on a shared-prefix trace; one JSON.

    python benchmarks/router.py                          # 2 replicas, CPU, about a minute
    python benchmarks/router.py --groups 16 --per-group 8 --prefix-len 192 --rate 8

The replicas are R ordinary `meshlm serve` processes (a tiny random Llama, one intra-op thread each, started and
stopped by `meshlm.infer.replicas.ReplicaSet` as `meshlm serve --replicas R` does); each policy's router
(`create_router_app`) runs over them in turn, in this process, on a port of its own. The trace: --groups
documents of --prefix-len random tokens, each asked --per-group times (the document, then --suffix-len tokens of
its own), the rounds interleaved and shuffled, streamed at Poisson arrivals of --rate requests/s. Each policy
gets the same trace in its own token ids (shifted), so the prefixes the first policy left in the engines' caches
do not help the second. Per policy: the router's prefix hit rate (requests sent to a replica already sent at
least half of their prompt), the engines' prefix-cache hit rate (prompt tokens found cached / looked up, from
the replicas' /metrics), requests per replica, and TTFT p50/p99 (request sent -> first streamed text).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import missing_extras, parse_args_smoke, print_result, print_smoke_skip


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) in `text`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def engine_counters(replicas) -> dict:
    """The replicas' engines' prefix-cache counters, summed."""
    import httpx

    texts = [httpx.get(r.url + "/metrics", timeout=30).text for r in replicas]
    return {key: sum(metric(t, f"meshlm_prefix_cache_{key}_tokens_total") for t in texts)
            for key in ("hit", "queried")}


def make_trace(args, vocab: int, rng: random.Random) -> list[list[int]]:
    """The shared-prefix trace: every group's requests once per round, each round in a random order."""
    docs = [[rng.randrange(2, vocab) for _ in range(args.prefix_len)] for _ in range(args.groups)]
    trace = []
    for _ in range(args.per_group):
        order = list(range(args.groups))
        rng.shuffle(order)
        trace += [docs[g] + [rng.randrange(2, vocab) for _ in range(args.suffix_len)] for g in order]
    return trace


def run_policy(name: str, replicas, trace: list[list[int]], args) -> dict:
    """One policy's router over the running replicas, the trace streamed through it; its figures."""
    import uvicorn

    from meshlm.infer.replicas import create_router_app
    from meshlm.infer.router import make_policy
    from meshlm.processes import free_port
    from serve import online_run

    policy = make_policy(name, len(replicas))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_router_app(replicas, policy), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    before = engine_counters(replicas)
    routed_before = [r.routed for r in replicas]
    try:
        t = time.perf_counter()
        results = asyncio.run(online_run(f"http://127.0.0.1:{port}", trace, args.output_len, args.rate, args.seed))
        wall = time.perf_counter() - t
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    after = engine_counters(replicas)
    hit, queried = after["hit"] - before["hit"], after["queried"] - before["queried"]
    ttft = sorted(r["ttft"] for r in results)
    return {"router_prefix_hit_rate": round(policy.hits / policy.requests, 3),
            "router_requests": policy.requests,  # the trace and online_run's one warm-up request
            "engine_prefix_cache_hit_rate": round(hit / queried, 3) if queried else None,
            "engine_prefix_cache_hit_tokens": int(hit), "engine_prefix_cache_queried_tokens": int(queried),
            "requests_per_replica": [r.routed - b for r, b in zip(replicas, routed_before)],
            "ttft_p50_ms": round(1e3 * statistics.median(ttft), 1),
            "ttft_p99_ms": round(1e3 * ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))], 1),
            "wall_seconds": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policies", default="round_robin,cache_aware", help="in this order (default both)")
    ap.add_argument("--groups", type=int, default=8, help="documents sharing a prefix (default 8)")
    ap.add_argument("--per-group", type=int, default=6, help="requests per document (default 6)")
    ap.add_argument("--prefix-len", type=int, default=128, help="tokens of a document (default 128)")
    ap.add_argument("--suffix-len", type=int, default=8, help="tokens of each request's own (default 8)")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second (Poisson; default 8)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of each replica (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    # --smoke: 3 documents of 32 tokens asked twice, 2 new tokens, a 1-layer model of hidden 32
    args = parse_args_smoke(ap, dict(groups=3, per_group=2, prefix_len=32, suffix_len=4, output_len=2, rate=50.0,
                                     hidden=32, layers=1, vocab=256))
    if args.smoke and (missing := missing_extras("transformers", "tokenizers", "fastapi", "uvicorn", "httpx")):
        print_smoke_skip("router", {"everything": f"needs {', '.join(missing)} (pip install -e \".[hf,serve]\")"})
        return
    from meshlm.infer.replicas import ReplicaSet
    from serve import make_model

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the replicas' intra-op threads
    policies = args.policies.split(",")
    rng = random.Random(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        max_len = args.prefix_len + args.suffix_len + args.output_len + 16
        vocab = make_model(path, hidden=args.hidden, layers=args.layers, vocab=args.vocab, max_len=max_len)
        trace = make_trace(args, vocab, rng)

        def command(index: int, port: int) -> list[str]:
            return [sys.executable, "-m", "meshlm.cli", "serve", "--model", str(path), "--port", str(port),
                    "--device", "cpu", "--served-model-name", "bench", "--kv-cache-mb", "64", "--quiet"]

        result = {"benchmark": "router", "replicas": args.replicas,
                  "model": {"hidden": args.hidden, "layers": args.layers, "vocab": vocab, "device": "cpu",
                            "threads_per_replica": args.threads, "cpu_cores": len(os.sched_getaffinity(0))},
                  "trace": {"groups": args.groups, "per_group": args.per_group, "prefix_len": args.prefix_len,
                            "suffix_len": args.suffix_len, "output_len": args.output_len, "rate_per_s": args.rate,
                            "requests": len(trace)}}
        with ReplicaSet(command, args.replicas, stdout=sys.stderr) as replicas:  # stdout: the JSON alone
            replicas.wait_until_healthy(300)
            for shift, name in enumerate(policies):
                shifted = [[(t - 2 + 7 * shift) % (vocab - 2) + 2 for t in p] for p in trace]
                result[name] = run_policy(name, replicas.replicas, shifted, args)
        result["replicas_left_running"] = sum(r.exit_code is None for r in replicas.replicas)
    print_result(result, args, started)


if __name__ == "__main__":
    main()
