"""Planner vs measured step time on this machine (`--cluster local`), printed as JSON.

    python benchmarks/planner_vs_measured.py [--calibration plan_calibration.json] [--steps 4]

Uses the calibration file written by `meshlm plan calibrate` (runs it first when the file is missing
or predates the core count), then, for each layout below, spawns `world` gloo ranks on this host
(one intra-op thread each), times real training steps of a tiny model (forward and backward of
every micro-batch, the bucketed data-parallel all-reduce of `meshlm.parallel.data` or the ZeRO
reduce-scatter / all-gathers of `meshlm.parallel.zero` with its `ZeroAdamW`, else AdamW; fp32)
and compares the fastest step (see `measure`) with the planner's prediction for the same model, batch and
layout. Each rank also counts its model-state bytes exactly (parameters, gradients, AdamW state
tensors, data-parallel bucket buffers; under ZeRO the flat master shard is counted with the
optimizer for stages 1/2 and as the weights for stage 3, as tests/test_planner_measured.py does),
printed next to the planner's memory components.

Layouts: the single process and data parallelism at world 2 and 4, with and without gradient
accumulation, with large and small buckets; ZeRO stages 1, 2, 3 at world 2 and 4 and hybrid
sharding (dp_replicate=2 x dp_shard=2) at world 4; tensor parallelism (`meshlm.parallel.tensor`,
vocab-parallel loss) tp=2 with and without sequence parallelism at world 2, and tp=2 x dp=2 (plain
DP over the TP shards) at world 4, where each row also reports the bytes the step moved over the
"tp" axis (CommStats) next to the planner's `tp_comm_bytes`. PP rows come when it lands.
`--only tp` (or dp, zero) runs a subset. On a host with fewer cores than ranks the ranks time-share the cores; the `local`
cluster models that from the core count the calibration recorded (see `cluster.local_cluster`),
so world 4 on 2 cores is predicted, not excused.

Output keys: `cluster` (what the calibration measured), `rows` (per layout: predicted_s,
measured_s, ratio = predicted / measured, the planner's time components, memory, and how much of
the cores the ranks got), `median_ratio`, and `median_ratio_uncontended` over the rows whose
measured pass had at least UNCONTENDED of its cores (the host is shared: other work on the same
cores slows a pass in a way no model of this machine can know).

--smoke: one pass, one timed step (after WARMUP) of one layout -- ZeRO-2 with
accumulation (DP's no_sync path too) -- with a 1-layer model of hidden 32 (SMOKE_MODEL); the calibration, unless
--calibration names an existing file, is measured with one repeat into a temporary file. Skips nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from _common import SMOKE_HELP  # benchmarks/ is on sys.path when run as a script
from meshlm.config import ModelConfig
from meshlm.planner.cluster import get_cluster
from meshlm.planner.cost import Job, Layout, estimate
from meshlm.processes import free_port
from meshlm.models.stats import count_params

# A tiny Llama (3.3M parameters, 13 MB of fp32 gradients): a step is ~0.1-0.5 s on one core, so the
# all-reduce is visible next to the compute, and the whole script runs in about two minutes.
MODEL = dict(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
             intermediate_size=768, max_seq_len=128)
SEQ_LEN = 128
SMOKE_MODEL = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                   intermediate_size=96, max_seq_len=16)
SMOKE_SEQ_LEN = 16
WARMUP = 2  # untimed steps per pass (the second step still ran ~20% slower than later ones here)
UNCONTENDED = 0.85  # core share above which a pass counts as undisturbed by other work on the host

# (world, global batch in sequences, micro-batch size, bucket size in MiB, ZeRO stage, dp_replicate,
# tp, sequence parallel); dp = world / tp; accumulation steps = global batch / (dp * micro-batch
# size); dp_shard = dp / dp_replicate.
LAYOUTS = [
    (1, 8, 8, 25.0, 0, 1, 1, False),   # the single-process baseline
    (2, 8, 4, 25.0, 0, 1, 1, False),   # DP 2, one bucket
    (2, 8, 2, 25.0, 0, 1, 1, False),   # DP 2, 2 accumulation steps
    (4, 8, 2, 25.0, 0, 1, 1, False),   # DP 4 (2 ranks per core here)
    (2, 8, 4, 4.0, 1, 1, 1, False),    # ZeRO-1, dp_shard 2
    (2, 8, 2, 4.0, 2, 1, 1, False),    # ZeRO-2, dp_shard 2, 2 accumulation steps
    (2, 8, 4, 25.0, 3, 1, 1, False),   # ZeRO-3, dp_shard 2 (a unit per block; gathers not overlapped)
    (4, 8, 2, 4.0, 1, 1, 1, False),    # ZeRO-1, dp_shard 4 (2 ranks per core here)
    (4, 8, 2, 25.0, 3, 1, 1, False),   # ZeRO-3, dp_shard 4
    (4, 8, 2, 4.0, 2, 2, 1, False),    # hybrid ZeRO-2: dp_replicate 2 x dp_shard 2
    (2, 8, 8, 25.0, 0, 1, 2, True),    # TP 2 + SP (vocab-parallel embedding, lm_head and loss)
    (2, 8, 8, 25.0, 0, 1, 2, False),   # TP 2 without SP (all-reduces)
    (4, 8, 4, 25.0, 0, 1, 2, True),    # TP 2 + SP x DP 2 (DP all-reduce of the TP shards)
]


def _kind(spec: tuple) -> str:
    return "tp" if spec[6] > 1 else "zero" if spec[4] else "dp"


def _model_state_bytes(model, opt, dp, zero) -> dict:
    """Exactly counted bytes this rank holds for model state (what the planner's memory test checks),
    after the optimizer step; `gradients` is replaced by the peak over the micro-steps by the caller
    (ZeRO-2/3 hold full gradients during accumulation, only the shard after the last micro-step)."""
    params = [p for p in model.parameters()]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    master = zero.param_shard.numel() * 4 if zero is not None else 0
    # the flat gradient shard exists from the first reduce-scatter of a step until zero_grad
    shard_grad = zero.grad_shard.numel() * 4 if zero is not None and zero.grad_shard is not None else 0
    return {
        "weights": sum(storages.values()) + (master if zero is not None and zero.stage == 3 else 0),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None) + shard_grad,
        "optimizer": sum(t.numel() * t.element_size() for st in opt.state.values()
                         for k, t in st.items() if k != "step" and torch.is_tensor(t))
        + (master if zero is not None and zero.stage < 3 else 0),
        "dp_buckets": sum((zero or dp).bucket_bytes) if (zero or dp) is not None else 0,
    }


def _rank(rank: int, world: int, port: int, spec: tuple, steps: int, out_queue, model_kw: dict = MODEL,
          seq_len: int = SEQ_LEN) -> None:
    from meshlm.comm_stats import CommStats
    from meshlm.mesh import ParallelDims, build_mesh
    from meshlm.models.transformer import build_model
    from meshlm.parallel.data import apply_data_parallel
    from meshlm.parallel.tensor import apply_tensor_parallel, tensor_parallel_grad_norm, vocab_parallel_cross_entropy
    from meshlm.parallel.zero import apply_zero
    from meshlm.parallel.zero_adamw import ZeroAdamW

    torch.set_num_threads(1)
    _, global_batch, mbs, bucket_mb, stage, dp_replicate, tp, sp = spec
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(**model_kw)
        model = build_model(cfg, seed=0)
        dp = zero = mesh = None
        stats = CommStats()
        dp_size, dp_rank = world // tp, rank
        if world > 1:
            dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=world // (dp_replicate * tp), tp=tp).resolve(world)
            mesh = build_mesh(dims, device_type="cpu", stats=stats)
            dp_rank = mesh.local_rank("dp")
        if tp > 1:  # TP first, then DP over "dp" on the local shards (parallel/parallelize.py's order)
            apply_tensor_parallel(model, mesh, sequence_parallel=sp)
        if stage > 0:
            zero = apply_zero(model, mesh, stage=stage, bucket_size_mb=bucket_mb)
            opt = ZeroAdamW(zero, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        else:
            if dp_size > 1:
                dp = apply_data_parallel(model, mesh, bucket_size_mb=bucket_mb, axis="dp")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sync = zero or dp
        local = global_batch // dp_size
        global_tokens = global_batch * seq_len
        times = []
        params = list(model.parameters())
        for step in range(steps + WARMUP):  # the first steps pay one-time allocations: not timed
            g = torch.Generator().manual_seed(step)
            seqs = torch.randint(0, cfg.vocab_size, (global_batch, seq_len + 1), generator=g)
            mine = seqs[dp_rank * local:(dp_rank + 1) * local]
            micro = list(zip(mine[:, :-1].split(mbs), mine[:, 1:].split(mbs)))
            dist.barrier()
            tp_bytes_before = stats.total(axis="tp").bytes
            start, cpu_start = time.perf_counter(), time.process_time()
            peak_grads = 0
            for i, (inputs, targets) in enumerate(micro):
                last = i == len(micro) - 1
                with sync.no_sync() if (sync is not None and not last) else torch.enable_grad():
                    logits = model(inputs)
                    if tp > 1:  # this rank's vocab slice of the logits
                        loss = vocab_parallel_cross_entropy(logits, targets, mesh, reduction="sum") / global_tokens
                    else:
                        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / global_tokens
                    loss.backward()
                if step == steps + WARMUP - 1:  # the last step only: counting is not free
                    # ZeRO's flat gradient shard exists only from the step's first reduce-scatter (none
                    # yet after an accumulation micro-step under no_sync) until zero_grad
                    shard = zero.grad_shard if zero is not None else None
                    peak_grads = max(peak_grads, sum(p.grad.numel() * 4 for p in params if p.grad is not None)
                                     + (shard.numel() * 4 if shard is not None else 0))
            if tp > 1:  # the trainer's clipping norm (one float over tp)
                tensor_parallel_grad_norm(params, mesh)
            opt.step()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if step == steps + WARMUP - 1:  # count before zero_grad frees the gradients
                state = {**_model_state_bytes(model, opt, dp, zero), "gradients": peak_grads}
                if tp > 1:
                    state["tp_comm_bytes"] = stats.total(axis="tp").bytes - tp_bytes_before
            opt.zero_grad(set_to_none=True)
            if step >= WARMUP:
                times.append((elapsed, cpu))
        out_queue.put((rank, times, state))
    finally:
        dist.destroy_process_group()


def measure(spec: tuple, *, steps: int, model_kw: dict = MODEL, seq_len: int = SEQ_LEN) -> dict:
    """Step times over `steps` steps (each: the slowest rank), rank 0's model-state bytes, and how much
    of the cores the ranks got (their CPU seconds over wall seconds times the cores they could use;
    below 1 when other work on the host took a share, or while ranks wait on a collective)."""
    world = spec[0]
    ctx = mp.get_context("spawn")
    out_queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, spec, steps, out_queue, model_kw, seq_len))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    while len(results) < world:
        try:
            rank, times, state = out_queue.get(timeout=1.0)
            results[rank] = (times, state)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank failed for layout {spec}: exit codes {[p.exitcode for p in procs]}")
    for p in procs:
        p.join()
    per_step = [max(results[r][0][i][0] for r in range(world)) for i in range(steps)]
    cpu = [sum(results[r][0][i][1] for r in range(world)) for i in range(steps)]
    usable = min(world, os.cpu_count() or 1)
    return {"times": per_step, "state": results[0][1],
            "core_share": statistics.median(c / (t * usable) for c, t in zip(cpu, per_step))}


def _needs_calibration(path: Path) -> bool:
    if not path.exists():
        return True
    return "cpu_cores" not in json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="plan_calibration.json")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout and pass (after WARMUP untimed)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all layouts")
    ap.add_argument("--only", choices=("dp", "zero", "tp"), help="run only the layouts of one kind")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    layouts = [spec for spec in LAYOUTS if args.only in (None, _kind(spec))]
    model_kw, seq_len = MODEL, SEQ_LEN
    if args.smoke:  # ZeRO-2 with accumulation; one pass, one step
        layouts = [spec for spec in (LAYOUTS[5],) if spec in layouts]
        model_kw, seq_len = SMOKE_MODEL, SMOKE_SEQ_LEN
        if "--steps" not in (argv or sys.argv[1:]):
            args.steps = 1
        if "--rounds" not in (argv or sys.argv[1:]):
            args.rounds = 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.calibration)
        if _needs_calibration(path):
            from meshlm.planner.calibrate import calibrate

            if args.smoke:  # a throwaway calibration: one repeat, not written where a real run would read it
                path = Path(tmp, "plan_calibration.json")
                calibrate(path, world_size=2, repeats=1)
            else:
                calibrate(path, world_size=2)
        local = get_cluster("local", calibration=path)
    cfg = ModelConfig(**model_kw)
    # Every layout is measured in `--rounds` passes spread over the run, so a burst of other work on
    # the host does not land on one layout only; the comparison figure is the fastest step of the
    # pass whose ranks got the largest share of their cores (closest to the idle host the planner
    # models). `core_share` of every pass is printed: well below 1 means other work took the cores
    # (or, for DP, that ranks waited on each other), and that row's ratio is correspondingly low.
    runs: dict = {spec: [] for spec in layouts}
    loads: dict = {spec: [] for spec in layouts}
    for _ in range(args.rounds):
        for spec in layouts:
            loads[spec].append(os.getloadavg()[0])
            runs[spec].append(measure(spec, steps=args.steps, model_kw=model_kw, seq_len=seq_len))
    rows = []
    for spec in layouts:
        world, global_batch, mbs, bucket_mb, stage, dp_replicate, tp, sp = spec
        dp_shard = world // (dp_replicate * tp)
        layout = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, sequence_parallel=sp,
                        zero_stage=stage, micro_batch_size=mbs, bucket_size_mb=bucket_mb)
        # meshlm's model runs eager here: one memory pass per elementwise op (Job.fused_elementwise)
        job = Job(seq_len=seq_len, global_batch_size=global_batch, precision="fp32", fused_elementwise=False, runtime="meshlm")
        est = estimate(cfg, local, job, layout, gpus=world)
        # The pass whose ranks got the most of their cores is the least disturbed by other work.
        best = max(runs[spec], key=lambda run: run["core_share"])
        measured, median, state = min(best["times"]), statistics.median(best["times"]), best["state"]
        load = max(loads[spec])
        predicted = est.time_s["step"]
        rows.append({
            "layout": (f"tp{tp}{'sp' if sp else ''} " if tp > 1 else "")
            + (f"dp{dp_replicate}x{dp_shard}" if dp_replicate > 1 else f"dp{dp_shard}")
            + (f" zero{stage}" if stage else "") + f" mbs{mbs} accum{est.num_microbatches} bucket{bucket_mb:g}MiB",
            "world": world, "global_batch": global_batch, "seq_len": seq_len,
            "predicted_s": round(predicted, 4), "measured_s": round(measured, 4),
            "measured_median_s": round(median, 4), "host_load_max": round(load, 2),
            "core_share": [round(run["core_share"], 2) for run in runs[spec]],
            "core_share_of_measured_pass": round(best["core_share"], 2),
            "contended": best["core_share"] < UNCONTENDED,
            "ratio": round(predicted / measured, 3),
            "predicted_components_s": {k: round(v, 4) for k, v in est.time_s.items() if k != "step" and v > 0},
            "memory_bytes": {
                "predicted": {k: round(est.memory_gib[k] * 2**30) for k in ("weights", "gradients", "optimizer",
                                                                            "comm_buffers")},
                "counted_rank0": state,
            },
            **({"tp_comm_bytes": {"predicted": round(est.tp_comm_bytes), "counted_rank0": state["tp_comm_bytes"]}}
               if tp > 1 else {}),
        })
    ratios = [r["ratio"] for r in rows]
    clean = [r["ratio"] for r in rows if not r["contended"]]
    print(json.dumps({
        "benchmark": "planner_vs_measured", "smoke": args.smoke,
        "cluster": {"matmul_flops": local.peak("fp32"), "memory_bandwidth": local.hbm_bw,
                    "link_bandwidth": local.scaleup_bw, "link_latency_per_hop": local.scaleup_latency,
                    "cores": local.compute_slots},
        "model_params": count_params(cfg)["total"],
        "rows": rows,
        "median_ratio": statistics.median(ratios),
        # rows whose best pass still had other work on the cores measure that work too
        "median_ratio_uncontended": statistics.median(clean) if clean else None,
        "uncontended_rows": len(clean),
        "pending": "PP rows: pipeline parallelism is not in meshlm.parallel yet",
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
