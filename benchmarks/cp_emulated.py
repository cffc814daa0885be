"""Context parallelism on an emulated two-tier cluster: ring, Ulysses and the hybrid, measured beside the planner.

    python benchmarks/cp_emulated.py                         # 2 nodes x 2 ranks, 100 Mbit/s between them; root
    python benchmarks/cp_emulated.py --inter-node-bw 50mbit --step-seq-len 1024

Needs root and iproute2 (`meshlm.emulate`: every node a network namespace, the nodes joined by links shaped to
--inter-node-bw; everything it creates is removed on exit, on Ctrl-C and on failure). One cp group spans all
the ranks: cp = nodes x procs-per-node (4), ranks 0-1 on node 0 and 2-3 on node 1. The layouts:
  ring      parallel.cp_method=ring: K/V blocks round all 4 ranks; 2 of the 4 hops cross the slow link
  ulysses   parallel.cp_method=ulysses: two all-to-alls over all 4 ranks each way; half of every rank's
            slices cross the slow link
  ring+u2   the hybrid (parallel.cp_ulysses=2): Ulysses' all-to-alls inside a node (loopback), the ring across
            the two nodes (one step, at the kv heads of a group)
Each rank enters its node (`enter_node`, gloo on the node's link), then, as tests/test_emulate.py does for the
planner's two-tier check: `planner.calibrate.measure_tiers` times the collectives these layouts issue inside a
node, across nodes and over all ranks while every rank runs (all_reduce for the gradients over "dp_cp",
all_to_all, p2p), and `emulated_calibration` + `cluster.local_cluster` turn that into the planner's cluster
(the compute rates from `emulated_machine`, measured alone before the ranks start). Then benchmarks/cp.py's
`time_steps` runs the step -- forward, backward, gradient all-reduce, AdamW -- of every layout, the layouts
alternating step by step, median over --steps after --warmup, the slowest rank counted. Printed per layout:
the measured step, the planner's `estimate(...).time_s["step"]` for the same model, batch, sequence and
layout on that calibrated cluster (its parts and which link each axis takes), their ratio, and the bytes
each rank sent per layer for the attention (CommStats) beside the planner's count.

Measured (the defaults, --steps 8: 2 nodes x 2 ranks on a 2-core host shared with other work, load average
~5, 100 Mbit/s between the nodes; hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 256, 2 sequences of 2048
tokens, fp32). Step, median of 8, ms, and the planner's prediction on the calibrated emulation:
    layout    measured  predicted  ratio   bytes/rank/layer sent (CommStats = planner)
    ring        815       1127     1.38    2,359,296
    ulysses     612        666     1.09    2,097,152
    ring+u2     731        675     0.92    2,359,296
Fastest first, measured and predicted alike: ulysses, ring+u2, ring. A first run at --steps 4 measured 861 /
566 / 661 ms against 1065 / 714 / 583 predicted (there the planner put the hybrid first). The ring is
over-predicted: the planner prices its node-crossing p2p steps at one rank's share of the node link (the
"scale-out" fit, every rank of a node crossing at once), but in a ring over consecutive ranks only one rank
per node crosses (1 -> 2, 3 -> 0) and gets the whole link -- its predicted cp_comm (758 ms) is about twice
what that link needs for the bytes.

Prints one JSON document and nothing else on stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from _common import parse_args_smoke, print_smoke_skip, run_ranks
from cp import planner_estimate, skip_reason, time_steps
from meshlm.comm_stats import CommStats
from meshlm.emulate import EmulatedCluster, check_host, parse_rate
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.planner.calibrate import emulated_calibration, emulated_machine, measure_tiers, tier_sizes
from meshlm.planner.cluster import local_cluster

CAL_KINDS = ("all_reduce", "all_to_all", "p2p")  # what the layouts issue (the ring's steps are p2p)
METHODS = ("ring", "ulysses", "ring+u2")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2, help="emulated nodes (default %(default)s)")
    ap.add_argument("--procs-per-node", type=int, default=2, help="ranks per node (default %(default)s)")
    ap.add_argument("--inter-node-bw", default="100mbit", help="each node's link, each way (default %(default)s)")
    ap.add_argument("--methods", default=",".join(METHODS), help="as benchmarks/cp.py's (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--step-seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (default %(default)s)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per layout (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default %(default)s)")
    # --smoke: 2 nodes x 1 rank (cp 2), ring and Ulysses (the hybrid needs cp >= 4), a 1-layer model of hidden 32,
    # one step of 2 x 64 tokens over a 1 Gbit/s link; where this host cannot emulate nodes, a JSON saying why
    args = parse_args_smoke(ap, dict(procs_per_node=1, inter_node_bw="1gbit", methods="ring,ulysses", hidden=32,
                                     layers=1, heads=2, kv_heads=1, vocab=64, step_seq_len=64, steps=1, warmup=0),
                            argv)
    args.device = "cpu"
    args.rate_bps = parse_rate(args.inter_node_bw)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.cp = args.nodes * args.procs_per_node
    bad = {m: why for m in args.methods if (why := skip_reason(m, args.cp, args))}
    if bad:
        ap.error(f"at cp={args.cp}: {bad}")
    if args.step_seq_len % (2 * args.cp):
        ap.error(f"--step-seq-len must divide by 2 x cp = {2 * args.cp}")
    return args


def _enter(rank: int, namespaces: list, procs_per_node: int) -> None:
    from meshlm.emulate import IFNAME, enter_node

    enter_node(namespaces[rank // procs_per_node])
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME  # torch's setting: gloo on the node's link


def _rank(rank: int, world: int, args) -> dict:
    tiers = measure_tiers(rank, world, procs_per_node=args.procs_per_node, repeats=3,
                          sizes=tier_sizes(args.rate_bps, args.procs_per_node), kinds=CAL_KINDS)
    mesh = build_mesh(ParallelDims(cp=world, dp_shard=1), device_type="cpu", stats=CommStats())
    return {"tiers": tiers, "steps": time_steps(args, mesh, world, torch.device("cpu"))}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        try:
            check_host()
        except (ValueError, RuntimeError, OSError) as e:
            print_smoke_skip("context_parallel_emulated", {"everything": str(e).splitlines()[0]})
            return
    start = time.perf_counter()
    machine = emulated_machine()  # alone on the cores, before the ranks start (as `plan calibrate --emulated`)
    with EmulatedCluster(nodes=args.nodes, rate_bps=args.rate_bps) as cluster:
        run = run_ranks(_rank, args.cp, args, master_addr=cluster.addresses[0],
                        before_init=functools.partial(_enter, namespaces=cluster.namespaces,
                                                      procs_per_node=args.procs_per_node))
    cal = emulated_calibration(run["tiers"], nodes=args.nodes, procs_per_node=args.procs_per_node,
                               rate_bps=args.rate_bps, machine=machine)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "calibration.json")
        path.write_text(json.dumps(cal))
        local = local_cluster(path)
    rows = {}
    for method in args.methods:
        got = run["steps"][method]
        est = planner_estimate(args, args.cp, method, cluster=local)
        rows[method] = {"measured_step_ms": got["step_ms_median"], "measured_step_ms_min": got["step_ms_min"],
                        "predicted_step_ms": round(est.time_s["step"] * 1e3, 1),
                        "ratio_predicted_over_measured": round(est.time_s["step"] * 1e3 / got["step_ms_median"], 3),
                        "predicted_parts_ms": {k: round(v * 1e3, 1) for k, v in est.time_s.items()
                                               if v and k != "step"},
                        "links": est.links,
                        "cp_bytes_per_rank_per_layer": got["cp_bytes_per_rank_per_layer"],
                        "planner_cp_bytes_per_rank_per_layer": got["planner_cp_bytes_per_rank_per_layer"],
                        "comm_this_rank": got["comm_this_rank"]}
    order = {"measured": sorted(rows, key=lambda m: rows[m]["measured_step_ms"]),
             "predicted": sorted(rows, key=lambda m: rows[m]["predicted_step_ms"])}
    print(json.dumps({
        "benchmark": "context_parallel_emulated", "smoke": args.smoke,
        "cluster": {"nodes": args.nodes, "procs_per_node": args.procs_per_node, "cp": args.cp,
                    "inter_node_bw_bps": args.rate_bps,
                    "fits_bytes_per_s": {tier: {k: round(v["bandwidth"]) for k, v in fits.items()}
                                         for tier, fits in (("scale-up", cal["collectives"]),
                                                            ("scale-out", cal["scale_out"]["collectives"]),
                                                            ("flat", cal.get("flat", {}).get("collectives", {})))},
                    "contention": run["tiers"].get("contention")},
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "vocab": args.vocab, "dtype": "fp32"},
        "step": {"seq_len": args.step_seq_len, "global_batch_seqs": args.batch, "warmup_steps": args.warmup,
                 "timed_steps": args.steps},
        "rows": rows, "order_fastest_first": order,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "wall_seconds": round(time.perf_counter() - start, 1)}, indent=2))


if __name__ == "__main__":
    main()
