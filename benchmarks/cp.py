"""meshlm context parallelism: how far a sequence reaches in a fixed per-rank memory budget, and what a step costs.

    python benchmarks/cp.py                                   # cp = 1, 2, 4 gloo ranks on CPU, ~2 minutes
    python benchmarks/cp.py --budget-mib 96 --cps 1,2 --methods ring
    python benchmarks/cp.py --no-peer --no-peak --step-seq-len 2048
    python benchmarks/cp.py --methods ring,allgather,ulysses,ring+u2 --heads 4 --kv-heads 2 --no-peer

For every cp in --cps, cp ranks are spawned (one intra-op thread each; cp=1 is one process and runs the
plain model, whose attention is `F.scaled_dot_product_attention`); every rank builds meshlm's reference
Transformer from the same seed and applies `parallelize(model, mesh, ParallelConfig(cp=cp, cp_method=m,
cp_ulysses=U))` -- context parallelism (`meshlm.parallel.context`) plus the gradient all-reduce over "dp_cp" --
and feeds it `ContextParallel.shard(tokens)` with `ContextParallel.positions(seq_len)`, as the trainer does.
--methods: ring, allgather, ulysses (parallel.cp_method) and the hybrid spelled ring+u<U> (cp_method=ring,
cp_ulysses=U: Ulysses within groups of U consecutive cp ranks, the ring across them). A method runs at the
cp values where the runtime allows it (ulysses: cp divides the heads; the hybrid: U divides cp, U divides the
heads, and cp >= 2U, a ring of at least two groups); elsewhere it is skipped, the reason under "skipped".

1. Longest sequence in a memory budget (the "memory" block). Per rank,
       bytes(seq) = model state + saved activations(seq)
   model state  parameters + gradients + AdamW exp_avg and exp_avg_sq, fp32: 16 bytes per parameter,
                the same on every cp rank (cp does not shard the model);
   saved activations  what autograd keeps for backward during a real forward (and the loss) of this
                rank's chunks of one sequence, measured by `SavedTensorMeter`; the largest over the
                cp ranks counts.
   The transient working memory of attention (the score blocks inside the ring, the softmax
   temporaries of backward) is NOT in that criterion: measuring it needs a whole training step per
   probe. Instead, at the sequence the search finds, one full step (forward, backward, gradient
   all-reduce, AdamW) runs under torch's MemTracker (benchmarks/_common.py `measure_step`) and its peak
   of live storages is printed next to the budget ("peak_step_*"): how much the criterion leaves out.
   The search, the same decisions on every rank: seq_len runs over multiples of 2*cp*--granule
   (context parallelism needs seq_len divisible by 2*cp); from --start-tokens x cp it doubles while
   the bytes fit --budget-mib, then bisects the bracket until it is narrower than max(one multiple,
   1/--tolerance of the fitting length). Reported: the longest fitting seq_len per cp and method,
   its ratio to cp=1 (the goal: ~cp), the saved bytes per token of each rank, every probe.
   Ring keeps 1/cp of the sequence's K/V per rank; allgather keeps every rank's K/V (kv heads) of every
   layer for backward; ulysses keeps what the model's own attention keeps for heads/cp over the whole
   sequence, per local token the same as without cp; the hybrid the ring's at its group's kv heads.

2. Step time at a fixed sequence (the "step_time" block): one global batch of --batch sequences of
   --step-seq-len tokens per step, forward + backward + AdamW step + zero_grad, at cp=1 (one process)
   and at every other cp (each rank its chunks of every sequence; loss = sum of token losses / global
   tokens, summed over the cp ranks). Median over --steps steps after --warmup, each started from a
   barrier and counted on the slowest rank; the methods alternate step by step. Per step also: the
   CPU seconds of every rank's process (time.process_time, all its threads: compute, gloo, Python),
   summed over ranks, and from `mesh.stats` (CommStats) the bytes this rank sent over "cp" (ring
   send / all-gather output / reduce-scatter input, see meshlm.comm) and over "dp_cp" (the gradient
   all-reduce), with the host seconds spent in those calls. Defined there:
     speedup                  wall(1) / wall(cp)
     rank_seconds_ratio       wall(cp) * cp / wall(1): rank-time per step against one rank doing it all;
                              1.0 is perfect scaling. When cp exceeds the host's cores the ranks share
                              cores and this counts the waiting too (host_cpu_cores says how many).
     cpu_seconds_ratio        CPU seconds of all ranks per step / CPU seconds of cp=1: the extra work
                              context parallelism does (communication, partial-result merges, per-block
                              Python), independent of how many cores there are.
   Per cp > 1 and method also, exact: cp_bytes_per_rank_per_layer, the bytes this rank sent for the
   attention in one step (CommStats on "cp", and for the hybrid "cp_ulysses" and "cp_ring": ring sends,
   all-gather outputs, reduce-scatter and all-to-all inputs; a ring's receives mirror its sends and are
   left out) / --layers, beside planner_cp_bytes_per_rank_per_layer, the planner's `Estimate.cp_comm_bytes`
   / --layers for the same model, batch (one micro-batch), seq_len and layout (fp32, eager elementwise).
   The losses of step 1 are printed per cp and method: they must agree with cp=1. One more row,
   ring_kernel_cp1: the cp=1 step with the ring's attention swapped in (one rank, one block, no
   communication) -- how much of the ring's extra CPU time is its explicit attention against SDPA's
   fused kernel rather than context parallelism itself.

3. Peer (the "peer" block): PyTorch's experimental context parallelism
   (`torch.distributed.tensor.experimental.context_parallel`, ring attention on DTensor) tried on the
   same gloo ranks and model -- once as is and once with SDPA forced to the math backend -- inside a
   try/except: whether it ran, its step time if it did, else the first line of its error.

4. The "summary" block: per method and cp, the measured and predicted bytes per rank per layer, the step
   time and the longest sequence of block 1, side by side.

On an emulated two-tier cluster (nodes as network namespaces, a slow link between them):
benchmarks/cp_emulated.py, which reuses `time_steps` and `planner_estimate` from here.

Prints one JSON document and nothing else on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import device_of, measure_step, parse_args_smoke, run_ranks, synchronize
from meshlm.comm_stats import CommStats
from meshlm.config import ModelConfig, ParallelConfig, TrainConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.parallel.context import apply_context_parallel, check_hybrid, check_ulysses
from meshlm.parallel.parallelize import parallelize
from meshlm.parallel.recompute import SavedTensorMeter
from meshlm.planner.cluster import get_cluster
from meshlm.planner.cost import Job, Layout, estimate
from meshlm.train.optim import build_optimizer

MIB = 2 ** 20
METHODS = ("ring", "allgather", "ulysses")  # parallel.cp_method; "ring+u<U>": the hybrid, parallel.cp_ulysses=U
CP_AXES = ("cp", "cp_ulysses", "cp_ring")  # where context parallelism's traffic is counted (CommStats)


def method_settings(name: str) -> tuple[str, int]:
    """A --methods entry -> (parallel.cp_method, parallel.cp_ulysses): "ulysses" -> ("ulysses", 1),
    "ring+u2" -> ("ring", 2)."""
    if name in METHODS:
        return name, 1
    base, _, u = name.partition("+u")
    if base == "ring" and u.isdigit() and int(u) >= 2:
        return "ring", int(u)
    raise ValueError(f"--methods entry {name!r} is none of {', '.join(METHODS)}, ring+u<U> (U >= 2)")


def skip_reason(name: str, cp: int, args) -> str | None:
    """Why method `name` does not run at `cp` (None: it runs) -- the runtime's own checks, and the hybrid
    only where its ring has at least two groups (at cp = U it is Ulysses)."""
    method, u = method_settings(name)
    try:
        if u > 1:
            check_hybrid(cp, u, method)
            if cp < 2 * u:
                return f"the hybrid with cp_ulysses={u} needs cp >= {2 * u} (at cp={u} it is ulysses)"
            check_ulysses(args.heads, args.kv_heads, cp=u, hybrid=True)
        elif method == "ulysses":
            check_ulysses(args.heads, args.kv_heads, cp=cp)
    except ValueError as e:
        return str(e)
    return None


def methods_at(args, cp: int) -> list[str]:
    return [m for m in args.methods if skip_reason(m, cp, args) is None] if cp > 1 else []


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cps", default="1,2,4", help="comma-separated cp degrees, one run each; 1 is the baseline "
                    "and always runs (default %(default)s)")
    ap.add_argument("--methods", default="ring,allgather", help="cp methods to run: parallel.cp_method (ring, "
                    "allgather, ulysses) or the hybrid ring+u<U> (cp_method=ring, cp_ulysses=U; runs where U divides "
                    "cp and cp >= 2U); a method the heads do not allow at some cp is skipped there "
                    "(default %(default)s)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: gloo ranks with one thread each; cuda: one GPU per rank, NCCL")
    model = ap.add_argument_group("model (meshlm's reference Transformer, MLP width 3 x hidden, GQA)")
    model.add_argument("--hidden", type=int, default=64, help="hidden size (default %(default)s)")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks (default %(default)s)")
    model.add_argument("--heads", type=int, default=2, help="attention heads (default %(default)s)")
    model.add_argument("--kv-heads", type=int, default=1, help="key/value heads (default %(default)s)")
    model.add_argument("--vocab", type=int, default=2048, help="vocabulary size (default %(default)s)")
    mem = ap.add_argument_group("1. longest sequence within a per-rank memory budget")
    mem.add_argument("--budget-mib", type=float, default=48.0,
                     help="per-rank budget: model state + saved activations (default %(default)s)")
    mem.add_argument("--start-tokens", type=int, default=512,
                     help="first probe: this many tokens per rank, i.e. seq_len = this x cp (default %(default)s)")
    mem.add_argument("--granule", type=int, default=16,
                     help="seq_len runs over multiples of 2 x cp x this (default %(default)s)")
    mem.add_argument("--tolerance", type=int, default=32,
                     help="bisection stops when the bracket is narrower than 1/this of the fitting length "
                          "(default %(default)s)")
    mem.add_argument("--no-peak", action="store_true",
                     help="skip the full step under MemTracker at the sequence found (the transient peak)")
    step = ap.add_argument_group("2. step time at a fixed sequence")
    step.add_argument("--step-seq-len", type=int, default=1024,
                      help="tokens per sequence (must divide by 2 x every cp; default %(default)s)")
    step.add_argument("--batch", type=int, default=2, help="sequences per global batch (default %(default)s)")
    step.add_argument("--steps", type=int, default=4, help="timed steps per method (default %(default)s)")
    step.add_argument("--warmup", type=int, default=1, help="untimed steps before those (default %(default)s)")
    ap.add_argument("--no-peer", action="store_true",
                    help="skip trying torch.distributed.tensor.experimental.context_parallel")
    # --smoke: cp 1 and 2, ring and ulysses, a 1-layer model of hidden 32, one step of 2 x 32 tokens, a budget
    # that the first probes exceed; no peer, no MemTracker peak
    args = parse_args_smoke(ap, dict(cps="1,2", methods="ring,ulysses", hidden=32, layers=1, heads=2, kv_heads=1,
                                     vocab=64, budget_mib=2.0, start_tokens=32, granule=8, tolerance=4,
                                     no_peak=True, step_seq_len=32, steps=1, warmup=0, no_peer=True), argv)
    args.cps = sorted({1, *(int(c) for c in args.cps.split(",") if c.strip())})
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        for m in args.methods:
            method_settings(m)
    except ValueError as e:
        ap.error(str(e))
    if min(args.cps) < 1 or not args.methods:
        ap.error(f"--cps must be integers >= 1 and --methods a non-empty subset of {list(METHODS)} or ring+u<U>")
    bad = [c for c in args.cps if args.step_seq_len % (2 * c)]
    if bad:
        ap.error(f"--step-seq-len={args.step_seq_len} must divide by 2 x cp for cp in {bad}")
    if args.device == "cuda" and max(args.cps) > torch.cuda.device_count():
        ap.error(f"--cps up to {max(args.cps)} needs that many GPUs; this machine has {torch.cuda.device_count()}")
    return args


def model_config(args) -> ModelConfig:
    # max_seq_len is not read by the model's forward (RoPE is computed from the positions given).
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads, intermediate_size=3 * args.hidden,
                       max_seq_len=1 << 20)


def _build(args, mesh, cp: int, name: str, device, seq_len: int):
    """A fresh model from seed 0, parallelized for `cp` (context parallelism + gradient all-reduce over dp_cp)
    by method `name` (a --methods entry)."""
    method, u = method_settings(name)
    model = build_model(model_config(args), seed=0, device=device)
    pm = parallelize(model, mesh, ParallelConfig(cp=cp, dp_shard=1, cp_method=method, cp_ulysses=u), seq_len=seq_len)
    return model, pm


def planner_estimate(args, cp: int, name: str, cluster=None):
    """The planner's estimate of the step `time_steps` runs: --batch sequences of --step-seq-len tokens,
    one micro-batch, fp32, eager elementwise (as meshlm runs on CPU), on `cluster` (bytes do not depend
    on it; default a100)."""
    method, u = method_settings(name)
    job = Job(seq_len=args.step_seq_len, global_batch_size=args.batch, precision="fp32", fused_elementwise=False,
              runtime="meshlm")
    layout = Layout(cp=cp, cp_method=method, cp_ulysses=u, micro_batch_size=args.batch)
    return estimate(model_config(args), cluster or get_cluster("a100"), job, layout, gpus=cp)


def _tokens(args, seed: int, num_seqs: int, seq_len: int, device):
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, args.vocab, (num_seqs, seq_len + 1), generator=g).to(device)
    return seqs[:, :-1], seqs[:, 1:]


def _local(pm, inputs, targets):
    """This rank's chunks and their true positions (the trainer's `local_batch`)."""
    if pm.context is None:
        return inputs, targets, None
    positions = pm.context.positions(inputs.shape[1], device=inputs.device)
    return pm.context.shard(inputs), pm.context.shard(targets), positions


def _max_over_ranks(value: float, device) -> float:
    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()



# --------------------------------------------------------------------------------------------
# 1. Longest sequence within the budget
# --------------------------------------------------------------------------------------------


def saved_bytes(model, pm, args, seq_len: int, device) -> int:
    """Bytes autograd saves for backward in a forward + loss of this rank's chunks of one sequence."""
    inputs, targets = _tokens(args, 0, 1, seq_len, device)
    x, y, positions = _local(pm, inputs, targets)
    with SavedTensorMeter(model) as meter:
        logits = model(x, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
    del logits, loss  # no backward: the graph and what it saved go
    return meter.bytes


def longest_sequence(model, pm, args, cp: int, state_bytes: int, device) -> dict:
    """Doubling, then bisection, over multiples of 2*cp*granule (identical decisions on every rank)."""
    budget = args.budget_mib * MIB
    unit = 2 * cp * args.granule
    probes = []

    def fits(seq: int) -> bool:
        start = time.perf_counter()
        b = int(_max_over_ranks(saved_bytes(model, pm, args, seq, device), device))
        ok = state_bytes + b <= budget
        probes.append({"seq_len": seq, "saved_mib": round(b / MIB, 3), "fits": ok,
                       "seconds": round(_max_over_ranks(time.perf_counter() - start, device), 2)})
        return ok

    seq = max(unit, args.start_tokens * cp // unit * unit)
    while not fits(seq):  # the start does not fit: halve down to one multiple
        if seq == unit:
            return {"max_seq_len": 0, "probes": probes}
        seq = max(unit, seq // 2 // unit * unit)
    lo, hi = seq, None
    while hi is None:  # doubling
        if fits(2 * lo):
            lo *= 2
        else:
            hi = 2 * lo
    while hi - lo > max(unit, lo // args.tolerance):  # bisection
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    saved = next(p["saved_mib"] for p in probes if p["seq_len"] == lo) * MIB
    return {"max_seq_len": lo, "first_failing_seq_len": hi,
            "saved_activation_mib": round(saved / MIB, 3),
            "saved_bytes_per_token_per_rank": round(saved / (lo / cp), 1),
            "probes": [[p["seq_len"], p["saved_mib"], p["fits"], p["seconds"]] for p in probes]}


def peak_of_full_step(model, pm, args, seq_len: int, device) -> dict:
    """One training step (forward, backward, gradient all-reduce, AdamW, zero_grad) at `seq_len` under
    MemTracker: the measured peak of live storages, transients included."""
    opt = build_optimizer(model, TrainConfig())
    for p in model.parameters():  # AdamW's state exists from the first step on: create it, unmeasured
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    inputs, targets = _tokens(args, 1, 1, seq_len, device)
    x, y, positions = _local(pm, inputs, targets)

    def step():
        logits = model(x, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / seq_len
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    row = measure_step(step, (model, opt), device)
    peak = int(_max_over_ranks(row["peak_memory_bytes"], device))
    return {"peak_step_mib": round(peak / MIB, 2), "peak_step_over_budget": round(peak / (args.budget_mib * MIB), 3),
            "peak_step_by_kind_mib": {k: round(v / MIB, 2) for k, v in row["peak_memory_by_kind"].items()}}


# --------------------------------------------------------------------------------------------
# 2. Step time at a fixed sequence
# --------------------------------------------------------------------------------------------


def time_steps(args, mesh, cp: int, device) -> dict:
    seq, nseq = args.step_seq_len, args.batch
    num_tokens = nseq * seq
    # cp=1 also times the ring's attention on one rank ("ring_kernel"): one block, no communication, the
    # same explicit per-chunk-pair attention as in the ring -- what the ring's compute costs against SDPA.
    methods = methods_at(args, cp) if cp > 1 else ["none", "ring_kernel"]
    runs = {}
    for method in methods:
        if method == "ring_kernel":
            model = build_model(model_config(args), seed=0, device=device)
            pm = SimpleNamespace(context=apply_context_parallel(model, mesh, method="ring"))
        else:
            model, pm = _build(args, mesh, cp, method if cp > 1 else "ring", device, seq)
        runs[method] = (model, pm, build_optimizer(model, TrainConfig()))

    def step(method: str, i: int) -> torch.Tensor:
        model, pm, opt = runs[method]
        inputs, targets = _tokens(args, 100 + i, nseq, seq, device)
        x, y, positions = _local(pm, inputs, targets)
        logits = model(x, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / num_tokens
        loss.backward()  # under cp: the gradient all-reduce over dp_cp runs in backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    wall = {m: [] for m in methods}
    cpu = {m: [] for m in methods}
    comm = {m: [] for m in methods}
    first_loss = {}
    for i in range(args.warmup + args.steps):
        for method in methods if i % 2 == 0 else methods[::-1]:
            mesh.stats.reset()
            if dist.get_world_size() > 1:
                dist.barrier()
            synchronize(device)
            c0, t0 = time.process_time(), time.perf_counter()
            loss = step(method, i)
            synchronize(device)
            t1, c1 = time.perf_counter(), time.process_time()
            if i == 0:
                first_loss[method] = loss
            if i >= args.warmup:
                wall[method].append(t1 - t0)
                cpu[method].append(c1 - c0)
                comm[method].append({key: (st.bytes, st.seconds) for key, st in mesh.stats.snapshot().items()})
    rows = {}
    for method in methods:
        w = torch.tensor(wall[method], dtype=torch.float64, device=device)
        c = torch.tensor(cpu[method], dtype=torch.float64, device=device)
        loss = first_loss[method].to(torch.float64).reshape(1)
        if dist.get_world_size() > 1:
            dist.all_reduce(w, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            dist.all_reduce(c)  # CPU seconds of all ranks
            dist.all_reduce(loss)  # each rank holds its tokens' share of the global mean
        keys = sorted({k for per_step in comm[method] for k in per_step})
        comm_row = {}
        for op, axis in keys:
            b = statistics.median([per_step.get((op, axis), (0, 0.0))[0] for per_step in comm[method]])
            sec = statistics.median([per_step.get((op, axis), (0, 0.0))[1] for per_step in comm[method]])
            comm_row.setdefault(axis, {})[op] = {"mib_per_step": round(b / MIB, 3),
                                                 "seconds_per_step": round(_max_over_ranks(sec, device), 4)}
        for axis, ops in comm_row.items():  # what left this rank (a receive is the same bytes arriving)
            moved = sum(v["mib_per_step"] for op, v in ops.items() if op != "recv")
            ops["moved_mib_per_step"] = round(moved, 3)
            ops["seconds_per_step"] = round(sum(v["seconds_per_step"] for v in ops.values() if isinstance(v, dict)), 4)
        rows[method] = {"step_ms_median": round(statistics.median(w.tolist()) * 1e3, 1),
                        "step_ms_min": round(min(w.tolist()) * 1e3, 1),
                        "cpu_seconds_all_ranks_per_step_median": round(statistics.median(c.tolist()), 3),
                        "comm_this_rank": comm_row, "loss_step1": loss.item()}
        if cp > 1 and method in args.methods:
            # what this rank sent for the attention, exact: every collective's bytes on the cp axes, less the
            # ring's receives (they mirror the sends) -- as the planner's Estimate.cp_comm_bytes counts
            sent = statistics.median([sum(b for (op, axis), (b, _) in per_step.items()
                                          if axis in CP_AXES and op != "recv") for per_step in comm[method]])
            rows[method]["cp_bytes_per_rank_per_layer"] = sent / args.layers
            rows[method]["planner_cp_bytes_per_rank_per_layer"] = (planner_estimate(args, cp, method).cp_comm_bytes
                                                                   / args.layers)
    return rows


# --------------------------------------------------------------------------------------------
# 3. The peer: torch's experimental context parallelism
# --------------------------------------------------------------------------------------------


def try_peer(args, mesh, cp: int, device) -> dict:
    seq, nseq = args.step_seq_len, args.batch
    out = {}
    try:
        from torch.distributed.tensor.experimental import context_parallel
    except Exception as e:  # noqa: BLE001 -- whatever keeps it from importing is the answer
        return {"imported": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for variant in ("default_sdpa", "math_sdpa"):
        model = build_model(model_config(args), seed=0, device=device)
        opt = build_optimizer(model, TrainConfig())
        cp_mesh = mesh.device_mesh["cp"]

        def step(i: int) -> None:
            inputs, targets = _tokens(args, 100 + i, nseq, seq, device)
            x, y = inputs.clone(), targets.clone()
            positions = torch.arange(seq, device=device)
            backend = sdpa_kernel([SDPBackend.MATH]) if variant == "math_sdpa" else contextlib.nullcontext()
            with backend, context_parallel(cp_mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 0],
                                           no_restore_buffers={x, y, positions}):
                logits = model(x, positions=positions)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / (nseq * seq)
                loss.backward()
            for p in model.parameters():  # the cp ranks saw different tokens: sum their gradients
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)

        try:
            times = []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(i)
                if i >= args.warmup:
                    times.append(_max_over_ranks(time.perf_counter() - t0, device))
            out[variant] = {"ran": True, "step_ms_median": round(statistics.median(times) * 1e3, 1)}
        except Exception as e:  # noqa: BLE001 -- the error is the result
            msg = str(e).splitlines()[0] if str(e) else ""
            out[variant] = {"ran": False, "error": f"{type(e).__name__}: {msg}"}
        if dist.get_world_size() > 1:
            dist.barrier()
    return out


# --------------------------------------------------------------------------------------------
# The ranks and the report
# --------------------------------------------------------------------------------------------


def _rank(rank: int, world_size: int, args) -> dict:
    device = device_of(args, rank)
    cp = world_size
    mesh = build_mesh(ParallelDims(cp=cp, dp_shard=1), device_type=device.type, stats=CommStats())
    result = {"cp": cp, "memory": {}}
    for method in (methods_at(args, cp) if cp > 1 else ["none"]):
        model, pm = _build(args, mesh, cp, method if cp > 1 else "ring", device, args.step_seq_len)
        state = 16 * sum(p.numel() for p in model.parameters())
        row = longest_sequence(model, pm, args, cp, state, device)
        if row["max_seq_len"] and not args.no_peak:
            row |= peak_of_full_step(model, pm, args, row["max_seq_len"], device)
        result["memory"][method] = row
        del model, pm
    result["step_time"] = time_steps(args, mesh, cp, device)
    if cp > 1 and not args.no_peer:
        result["peer"] = try_peer(args, mesh, cp, device)
    return result


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def report(args, runs: dict[int, dict], seconds: float) -> dict:
    base = runs[1]
    params = build_model(model_config(args), seed=0).num_params()
    state = 16 * params
    memory = {}
    for method in args.methods:
        rows = []
        for cp, run in runs.items():
            if cp > 1 and method not in run["memory"]:
                continue  # skipped at this cp (see "skipped")
            row = dict(run["memory"]["none" if cp == 1 else method])
            longest = row.pop("max_seq_len")
            rows.append({"cp": cp, "max_seq_len": longest,
                         "ratio_to_cp1": _ratio(longest, base["memory"]["none"]["max_seq_len"]), **row})
        memory[method] = rows
    step = {}
    b = base["step_time"]["none"]
    kernel = base["step_time"]["ring_kernel"]
    step["ring_kernel_cp1"] = {**kernel, "cpu_seconds_ratio": _ratio(kernel["cpu_seconds_all_ranks_per_step_median"],
                                                                    b["cpu_seconds_all_ranks_per_step_median"])}
    for method in args.methods:
        rows = [{"cp": 1, **b}]
        for cp, run in runs.items():
            if cp == 1 or method not in run["step_time"]:
                continue
            r = run["step_time"][method]
            rows.append({"cp": cp, **r,
                         "speedup": _ratio(b["step_ms_median"], r["step_ms_median"]),
                         "rank_seconds_ratio": _ratio(r["step_ms_median"] * cp, b["step_ms_median"]),
                         "cpu_seconds_ratio": _ratio(r["cpu_seconds_all_ranks_per_step_median"],
                                                     b["cpu_seconds_all_ranks_per_step_median"]),
                         "loss_step1_abs_diff_vs_cp1": abs(r["loss_step1"] - b["loss_step1"])})
        step[method] = rows
    # one line per method and cp: the numbers above side by side
    summary = {}
    for method in args.methods:
        per_cp = {}
        for cp, run in runs.items():
            if cp == 1 or method not in run["step_time"]:
                continue
            r = run["step_time"][method]
            mem = run["memory"].get(method, {})
            per_cp[str(cp)] = {"cp_bytes_per_rank_per_layer": r["cp_bytes_per_rank_per_layer"],
                               "planner_cp_bytes_per_rank_per_layer": r["planner_cp_bytes_per_rank_per_layer"],
                               "step_ms_median": r["step_ms_median"], "max_seq_len": mem.get("max_seq_len")}
        summary[method] = per_cp
    skipped = {m: {str(cp): why for cp in args.cps if cp > 1 and (why := skip_reason(m, cp, args))}
               for m in args.methods}
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    out = {
        "benchmark": "context_parallel", "device": args.device,
        "backend": "nccl" if args.device == "cuda" else "gloo", "host_cpu_cores": cores,
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "vocab": args.vocab, "params": params, "dtype": "fp32"},
        "memory": {
            "budget_mib": args.budget_mib,
            "criterion": "per rank: model state (params + grads + AdamW exp_avg/exp_avg_sq, fp32, 16 B/param, "
                         "not sharded by cp) + activations saved for backward (SavedTensorMeter over a real "
                         "forward + loss of this rank's chunks of one sequence, max over cp ranks); attention's "
                         "transient working memory is not in the criterion -- peak_step_mib is the MemTracker "
                         "peak of one whole training step at max_seq_len, transients included",
            "model_state_mib": round(state / MIB, 3),
            "search": f"seq_len over multiples of 2*cp*{args.granule}; from {args.start_tokens}*cp doubling, "
                      f"then bisection to within max(one multiple, 1/{args.tolerance})",
            "results": memory},
        "step_time": {
            "seq_len": args.step_seq_len, "global_batch_seqs": args.batch,
            "warmup_steps": args.warmup, "timed_steps": args.steps,
            "step": "forward + backward (+ gradient all-reduce over dp_cp) + AdamW step + zero_grad; wall = "
                    "slowest rank, from a barrier",
            "definitions": {
                "speedup": "step_ms(cp=1) / step_ms(cp)",
                "rank_seconds_ratio": "step_ms(cp) * cp / step_ms(cp=1): 1.0 = perfect scaling; includes "
                                      "waiting for a core when cp > host_cpu_cores",
                "cpu_seconds_ratio": "CPU seconds of all ranks' processes per step / those of cp=1: the extra "
                                     "work of context parallelism, whatever the number of cores",
                "ring_kernel_cp1": "cp=1, one process, with the ring's attention swapped in (one block, no "
                                   "communication): the same step with the ring's explicit per-chunk-pair "
                                   "attention instead of SDPA's fused kernel; its cpu_seconds_ratio is the part of "
                                   "the ring's cpu_seconds_ratio that is the attention kernel, not parallelism",
                "comm_this_rank": "from mesh.stats (CommStats), per step, per axis and op, median over the timed "
                                  "steps, rank 0's bytes: 'cp' = the attention's traffic (ring: send and recv of "
                                  "K/V blocks and partial dK/dV; allgather: all-gather output + reduce-scatter "
                                  "input), 'dp_cp' = the gradient all-reduce; moved_mib_per_step = everything but "
                                  "recv (a receive counts the same bytes again at the other end); seconds = host "
                                  "time inside those calls and their waits (max over ranks)"},
            "results": step},
        "summary": {
            "what": "per method and cp: bytes this rank sent per layer for the attention, measured (CommStats on "
                    "the cp axes -- 'cp', and for the hybrid 'cp_ulysses' and 'cp_ring' -- less the ring's "
                    "receives, per step / layers) and predicted (the planner's Estimate.cp_comm_bytes / layers, "
                    "same model, batch, seq_len and layout, fp32); the step time; the longest sequence in the "
                    "memory budget",
            "results": summary},
        "skipped": {m: why for m, why in skipped.items() if why},
        "wall_seconds": round(seconds, 1),
    }
    if not args.no_peer:
        peers = {cp: run["peer"] for cp, run in runs.items() if "peer" in run}
        out["peer"] = {
            "what": "torch.distributed.tensor.experimental.context_parallel (DTensor ring attention via the SDPA "
                    "dispatcher), same model, same gloo ranks, same step; tried as is and with SDPA forced to "
                    "the math backend",
            "torch": torch.__version__,
            "results": {str(cp): p for cp, p in peers.items()}}
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    runs = {cp: run_ranks(_rank, cp, args) for cp in args.cps}
    print(json.dumps({**report(args, runs, time.perf_counter() - start), "smoke": args.smoke}, indent=2))


if __name__ == "__main__":
    main()
