"""benchmarks/cp.py's byte accounting for Ulysses and the hybrid at cp=4, against the planner's count.

tests/test_planner_cp.py checks CommStats against `Estimate.cp_comm_bytes` at cp=2, where the hybrid
(cp_ulysses=2) is a ring of one group: its all-to-alls, never its ring steps. Here four gloo ranks run the
benchmark's own `time_steps` (one step, a tiny model) for ulysses and ring+u2, so the hybrid's ring across
two groups ("cp_ring") is counted too, and the benchmark's bytes per rank and layer must equal its planner
figure and the volumes of parallel/context.py's docstring.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from dist import run_distributed

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
ARGS = dict(methods=["ulysses", "ring+u2"], hidden=32, layers=2, heads=4, kv_heads=2, vocab=64,
            step_seq_len=32, batch=2, warmup=0, steps=1, device="cpu")
CP = 4


def _bench_cp():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # cp.py imports benchmarks/_common.py as `_common`
    spec = importlib.util.spec_from_file_location("bench_cp", BENCH / "cp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps_worker(rank, world_size):
    import torch

    from meshlm.comm_stats import CommStats
    from meshlm.mesh import ParallelDims, build_mesh

    bench = _bench_cp()
    mesh = build_mesh(ParallelDims(cp=world_size, dp_shard=1), device_type="cpu", stats=CommStats())
    return bench.time_steps(SimpleNamespace(**ARGS), mesh, world_size, torch.device("cpu"))


def test_benchmark_cp_bytes_for_ulysses_and_the_hybrid_equal_the_planners():
    rows = run_distributed(_steps_worker, CP, timeout=120)[0]
    for method in ARGS["methods"]:
        row = rows[method]
        assert row["cp_bytes_per_rank_per_layer"] == row["planner_cp_bytes_per_rank_per_layer"], (method, row)
    # the volumes of context.py's docstring: T tokens per rank, d head_dim, E = 4 (fp32), h heads, kv heads g
    tokens, d, h = ARGS["batch"] * ARGS["step_seq_len"] // CP, ARGS["hidden"] // ARGS["heads"], ARGS["heads"]
    g4, g2 = 4, 2  # lcm(2 kv heads, 4) for Ulysses over 4; lcm(2, 2) for the hybrid's groups of 2
    assert rows["ulysses"]["cp_bytes_per_rank_per_layer"] == 4 * tokens * d * 4 * (h + g4)
    kv_pair = 2 * tokens * d * 4 * g2  # K + V of the group's tokens at g / U heads
    ring = (CP // 2 - 1) * (kv_pair + 2 * kv_pair)  # forward K+V; backward K+V and dK+dV
    assert rows["ring+u2"]["cp_bytes_per_rank_per_layer"] == 4 * tokens * d * 4 * (h + g2) + ring
    # the hybrid's traffic really is on both of its axes
    assert {"cp_ulysses", "cp_ring"} <= set(rows["ring+u2"]["comm_this_rank"])
