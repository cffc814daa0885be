"""Disaggregated prefill/decode against colocated serving on the same ranks, under a mixed load; one JSON.

    python benchmarks/serve_disagg.py                        # 2 ranks, CPU, a few minutes
    python benchmarks/serve_disagg.py --long-len 1024 --long 6 --short 16 --rate 6
    python benchmarks/serve_disagg.py --parts emulated --inter-node-bw 100mbit  # 2 emulated nodes; root

The load: --short requests of --short-len random tokens generating --short-out tokens each (the running decodes)
and, among them, --long requests of --long-len tokens generating --long-out (the long prompts that stall every
decode of a colocated engine while they prefill), shuffled and streamed at Poisson arrivals of --rate requests/s
(`serve.online_run`'s client: TTFT = request sent -> first streamed text, TPOT = (last chunk - first chunk) /
(tokens - 1)). The parts colocated and disaggregated (the default --parts) use --ranks ranks (one intra-op thread each) of a tiny random Llama on CPU behind
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
and KV and meshlm's engine (its host time per step from the calibration, where the file has it), as the run is;
each figure as predicted, measured and ratio = predicted / measured (TTFT and TPOT: the measured medians).

The part `emulated` (--parts ...,emulated; root and iproute2): the disaggregated deployment again, on `meshlm cluster
emulate --nodes 2 --procs-per-node P --inter-node-bw RATE` (P = each instance's ranks, which must be equal): the
prefill instance on emulated node 0, the decode instance on node 1, every KV transfer over the shaped link. The
load runs inside node 0 (where the front answers). Printed: TTFT/TPOT/throughput as above, the KV transfers (the
server's /metrics: transfers, tokens sent and skipped, bytes, seconds), the bytes each node's link carried, and the
planner's prediction for the same deployment on that emulated cluster (`meshlm plan infer --cluster local
--calibration FILE --disaggregate P:P`, the transfer priced on the scale-out link) from --emulated-calibration
(a `meshlm plan calibrate --emulated` file for the same nodes, ranks and rate; measured first when absent, about
a minute); where this host cannot emulate nodes it prints a skipped entry. --smoke leaves it out (it takes a
minute; tests/test_serve_nodes.py runs the pair on emulated nodes), `--smoke --parts emulated` runs it without
measuring a calibration. --smoke runs the disaggregated part alone (`--smoke --parts ...` the others).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import missing_extras, parse_args_smoke, predicted_vs_measured, print_result, print_smoke_skip


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
    out = {"precision": "fp32 (plan infer's default on --cluster local)"}
    for name, extra in (("colocated", ["--gpus", str(prefill.ranks + decode.ranks)]),
                        ("disaggregated", ["--disaggregate", f"{prefill.ranks}:{decode.ranks}"])):
        out[name] = predict(path, calibration, trace, measured[name], layout=prefill, extra=extra)
    return out


def predict(path: Path, calibration: str, trace, measured: dict, *, layout, extra: list[str]) -> dict:
    """`meshlm plan infer --cluster local --calibration CALIBRATION --layout LAYOUT EXTRA` at the measured mean
    concurrency and the trace's mean input and output lengths, beside the measured figures."""
    ins = round(statistics.mean(len(p) for p, _, _ in trace))
    outs = round(statistics.mean(o for _, o, _ in trace))
    concurrency = max(1, round(measured["mean_concurrency"]))
    argv = [sys.executable, "-m", "meshlm.cli", "plan", "infer", "--model", str(path), "--cluster", "local",
            "--calibration", calibration, "--layout", f"tp={layout.tp},cp={layout.cp}", "--input-len", str(ins),
            "--output-len", str(outs), "--concurrency", str(concurrency), "--json", *extra]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip()[-500:]}
    r = json.loads(done.stdout)
    r = r[0] if isinstance(r, list) else r
    out = {"input_len": ins, "output_len": outs, "concurrency": concurrency, "bound": r.get("bound"),
           **{k: round(r[k], 3) for k in ("kv_transfer_s",) if k in r},
           # the measured TTFT and TPOT are medians (p50)
           **predicted_vs_measured({k: (r.get(k), measured.get({"ttft_ms": "ttft_p50_ms", "tpot_ms": "tpot_p50_ms"}
                                                                .get(k, k)))
                                    for k in ("output_tokens_per_s", "ttft_ms", "tpot_ms")})}
    if "kv_transfer_bytes_per_request" in r:
        out["kv_transfer_bytes_per_request"] = round(r["kv_transfer_bytes_per_request"])
    return out


# ---------------------------------------------------------------------------------------------
# The part `emulated`: prefill and decode on two emulated nodes
# ---------------------------------------------------------------------------------------------

NODE_PORT = 8000  # the front's port inside node 0's namespace (a fresh namespace: every port is free)


@contextlib.contextmanager
def emulated_server(serve_args: list[str], *, procs_per_node: int, rate: str, timeout_s: float, info: dict):
    """`meshlm cluster emulate --nodes 2 ... -- meshlm serve SERVE_ARGS` in a session of its own; yields node 0's
    namespace once it exists (the server may still be loading); on exit stops it (its namespaces go with it) and
    puts in `info` how that went and the bytes each node's link carried."""
    from meshlm.processes import stop_tree

    argv = [sys.executable, "-m", "meshlm.cli", "cluster", "emulate", "--nodes", "2", "--procs-per-node",
            str(procs_per_node), "--inter-node-bw", rate, "--", "meshlm", "serve", *serve_args, "--port",
            str(NODE_PORT), "--quiet"]
    errors = tempfile.TemporaryFile(mode="w+")  # not a pipe: nobody reads it while the server runs
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    namespace = f"meshlm{proc.pid}-n0"  # run_emulated's name for node 0
    try:
        deadline = time.monotonic() + timeout_s
        while not Path("/run/netns", namespace).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                errors.seek(0)
                raise RuntimeError(f"meshlm cluster emulate did not start: {errors.read()[-2000:]}")
            time.sleep(0.05)
        yield namespace
    finally:
        info["server_stopped"] = stop_tree(proc, 30)
        errors.seek(0)
        text = errors.read()
        errors.close()
        links = [[int(a), int(b)] for a, b in re.findall(r"node \d+ sent (\d+) B, received (\d+) B", text)]
        info["node_links_sent_received_bytes"] = links or text[-2000:]


def load_in_node(namespace: str, trace, rate: float, seed: int, timeout_s: float) -> tuple[dict, str]:
    """In a process of its own, inside `namespace` (node 0): wait for the server, run the load, read /metrics."""
    import httpx

    from meshlm.emulate import enter_node
    from meshlm.infer.client import wait_until_healthy

    enter_node(namespace)
    url = f"http://127.0.0.1:{NODE_PORT}"
    wait_until_healthy(url, timeout_s=timeout_s, poll_s=0.2)
    result = run_load(url, trace, rate, seed)
    return result, httpx.get(url + "/metrics", timeout=30).text


def kv_counters(metrics: str) -> dict:
    """The KV transfers' counters of a disaggregated server's /metrics (behind its front: replica="0")."""
    out = {}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith("meshlm_kv_transfer"):
            out[name.removeprefix("meshlm_").removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
        elif name == "meshlm_comm_bytes_total" and 'axis="kv"' in line:
            out["rank0_comm_bytes_on_kv"] = float(line.rsplit(" ", 1)[1])
    return {k: round(v, 4) if k.endswith("seconds") else int(v) for k, v in out.items()}


def emulated_calibration(path: str, *, procs_per_node: int, rate: str, smoke: bool) -> tuple[str | None, str]:
    """(the `plan calibrate --emulated` file for 2 nodes x `procs_per_node` ranks at `rate`, how it came) --
    `path` when it describes that cluster, else measured into it when absent (not in a smoke run: None)."""
    from meshlm.emulate import parse_rate

    rate_bps = parse_rate(rate)
    if Path(path).exists():
        emu = json.loads(Path(path).read_text()).get("emulated") or {}
        want = {"nodes": 2, "procs_per_node": procs_per_node, "inter_node_bw_bps": rate_bps}
        if {k: emu.get(k) for k in want} != want:
            raise SystemExit(f"--emulated-calibration {path} calibrates another cluster ({emu or 'not an emulated one'}"
                             f"), not {want}; delete it (it is measured again) or name another file")
        return path, "read"
    if smoke:
        return None, (f"no {path}, and a smoke run measures none (about a minute): meshlm plan calibrate --emulated "
                      f"--nodes 2 --nproc-per-node {procs_per_node} --inter-node-bw {rate} --out {path}")
    from meshlm.planner.calibrate import calibrate_emulated

    calibrate_emulated(path, nodes=2, procs_per_node=procs_per_node, rate_bps=rate_bps)
    return path, "measured"


def run_emulated(args, path: Path, trace, prefill, decode, serve_flags: list[str]) -> dict:
    """The part `emulated` (the module docstring)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from meshlm.emulate import check_host, parse_rate

    try:
        check_host()
    except ValueError as e:
        if args.smoke:
            return {"skipped": str(e)}
        raise SystemExit(f"the part emulated: {e}") from None
    if prefill.ranks != decode.ranks:
        raise SystemExit(f"the part emulated puts each instance on a node of its own: --prefill {prefill.label()} and "
                         f"--decode {decode.label()} must have as many ranks")
    rate_bps = parse_rate(args.inter_node_bw)
    calibration, how = emulated_calibration(args.emulated_calibration, procs_per_node=prefill.ranks,
                                            rate=args.inter_node_bw, smoke=args.smoke)
    out = {"nodes": 2, "procs_per_node": prefill.ranks, "inter_node_bw_bps": rate_bps,
           "placement": f"prefill {prefill.label()} on node 0, decode {decode.label()} on node 1, the front on node 0"}
    with emulated_server(serve_flags, procs_per_node=prefill.ranks, rate=args.inter_node_bw, timeout_s=600,
                         info=out) as namespace, \
            ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        measured, metrics = pool.submit(load_in_node, namespace, trace, args.rate, args.seed, 600).result()
    out.update(measured=measured, kv=kv_counters(metrics))
    if calibration is None:
        out["planner"] = {"skipped": how}
    else:
        out["planner"] = {"calibration": f"{calibration} ({how})", "precision": "fp32 (plan infer's default on --cluster local)",
                          **predict(path, calibration, trace, measured, layout=prefill,
                                    extra=["--disaggregate", f"{prefill.ranks}:{decode.ranks}"])}
    return out


PARTS = ("colocated", "disaggregated", "emulated")


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
    ap.add_argument("--parts", default="colocated,disaggregated",
                    help=f"what to run, of {','.join(PARTS)} (default %(default)s)")
    ap.add_argument("--inter-node-bw", default="1gbit",
                    help="the part emulated: each emulated node's link, each way (default %(default)s)")
    ap.add_argument("--emulated-calibration", default="plan_calibration_emulated.json", metavar="FILE",
                    help="the part emulated: a `meshlm plan calibrate --emulated` file of the same cluster for the "
                         "planner's prediction (measured into FILE when absent; default %(default)s)")
    args = parse_args_smoke(ap, dict(short=3, short_len=8, short_out=4, long=1, long_len=48, long_out=2, rate=50.0,
                                     hidden=32, layers=1, vocab=256, max_num_batched_tokens=32, parts="disaggregated"))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts {args.parts!r}: give some of {', '.join(PARTS)}")
    if missing := missing_extras("transformers", "tokenizers", "fastapi", "uvicorn", "httpx"):
        print_smoke_skip("serve_disagg", {"everything": f"needs {', '.join(missing)} (pip install -e \".[hf,serve]\")"})
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
        common = ["--model", str(path), "--served-model-name", "bench", "--device", "cpu", "--kv-cache-mb", "64"]
        deployments = {"colocated": ["--replicas", str(args.ranks), "--router", "round_robin", *budget],
                       "disaggregated": ["--prefill", args.prefill, "--decode", args.decode, *budget]}
        for name in ("colocated", "disaggregated"):
            if name not in parts:
                continue
            stopped = {}
            with meshlm_server([*common, *deployments[name]], threads=1, timeout_s=600, stopped=stopped) as url:
                result[name] = run_load(url, trace, args.rate, args.seed)
            result[name]["server_stopped"] = stopped
        if "colocated" in parts and "disaggregated" in parts:
            result["planner"] = planner(path, args.calibration, trace, result, prefill=prefill, decode=decode)
        if "emulated" in parts:
            result["emulated"] = run_emulated(args, path, trace, prefill, decode,
                                              [*common, *deployments["disaggregated"]])
    # under --smoke: the colocated servers are the router's (benchmarks/router.py smokes them); emulated nodes take
    # a minute with root (tests/test_serve_nodes.py runs the pair on them)
    print_result(result, args, started,
                 smoke_skipped={p: f"not in --smoke (--smoke --parts {p} runs it)" for p in PARTS if p not in parts})


if __name__ == "__main__":
    main()
