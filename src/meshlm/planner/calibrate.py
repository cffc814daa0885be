"""Measure this machine for the `local` cluster: matmul FLOP/s, collective latency/bandwidth, and (from
`calibrate_serving`) a GEMM's weight pass and meshlm's serving engine's host work.

Responsible for: timing fp32 matmuls of a few sizes and causal attention (forward + backward) in this
process (one thread: one core's rate),
recording how many cores local ranks share (the cost model divides the per-core rate when ranks
outnumber cores), spawning `world_size` local
gloo ranks (one thread each) that time all_reduce, all_gather, reduce_scatter, all_to_all and
send/recv over message sizes, fitting `time = latency + bytes_moved / bandwidth` to each, and writing
the JSON file that `cluster.local_cluster` reads.
With `emulated` (`calibrate_emulated`): the same on an emulated two-tier cluster (`meshlm.emulate`: nodes
as network namespaces joined by shaped links), every rank of the host running at once as in training
(`measure_tiers`): "scale-up" on each node's ranks (loopback), "scale-out" on one rank per node with every
rank of a node crossing at once (each in its own group of one rank per node, as the data-parallel groups
of a tp-inside-the-node layout do), so the fit is one rank's share of its node's link, the per-GPU figure
the cost model reads, and "flat", one ring over all the ranks (gloo's ring across nodes); each also after
a slice of compute on every rank (a call's wait for busy peers: `call_overhead`); the slowdown of compute
when every rank computes (`measure_contention`); and the fixed framework cost of a step
(`measure_step_overhead`). `emulated_calibration` writes them in the cost model's per-core terms.
The serving model's own measurements (`calibrate_serving`: the engine's host work per step, layer and sequence;
a GEMM's weight pass) are written to the same file.
Not responsible for: the cost model (the fit is expressed in the same terms `cost.collective_time`
uses: a ring moves (n-1)/n of the buffer per rank and per phase) or creating namespaces (`meshlm.emulate`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from meshlm.planner.calibrate_serving import measure_gemm_weight_pass, measure_serving_host
from meshlm.processes import free_port

SIZES = (2**12, 2**16, 2**20, 2**22)  # bytes per message (fp32 elements x 4)
RING_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
BACK_TO_BACK = 8  # calls per timed run of a collective (`_time_collectives`' default)


def measure_matmul(*, sizes=(256, 512, 1024), repeats: int = 5) -> float:
    """Sustained fp32 matmul FLOP/s (one thread, as the ranks run): the median of `repeats` timings
    of each square size, best size -- a median, not the luckiest run, since training sustains it."""
    import statistics

    import torch

    torch.set_num_threads(1)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            rates.append(2 * n**3 / (time.perf_counter() - t))
        best = max(best, statistics.median(rates))
    return best


def measure_attention(*, batch: int = 4, heads: int = 4, seq_len: int = 256, head_dim: int = 64,
                      repeats: int = 5) -> float:
    """Causal scaled-dot-product attention, forward + backward, in FLOP/s as FlashAttention counts them
    (the unmasked half of the square; backward 2.5x forward) -- what `attention_efficiency` means."""
    import statistics

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, requires_grad=True) for _ in range(3))
    flops = 4 * batch * heads * seq_len * seq_len * head_dim * 0.5 * 3.5
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        if i:  # the first call pays one-time setup
            times.append(time.perf_counter() - t)
    return flops / statistics.median(times)


def measure_memory_bandwidth(*, nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    import torch

    x = torch.empty(nbytes // 4)
    y = torch.empty_like(x)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        y.copy_(x)
        best = max(best, 2 * nbytes / (time.perf_counter() - t))  # read + write
    return best


def fit_attention(*, short: int = 128, long: int = 512, tokens: int = 2048) -> dict:
    """Attention rate over the query length L as rate(L) = R * L / (L + L0), from two lengths at equal
    tokens: R is `attention_flops` (the long-sequence rate), L0 `attention_block_overhead` (tokens),
    the same form the cost model applies to GPU presets."""
    r1 = measure_attention(batch=tokens // short, seq_len=short)
    r2 = measure_attention(batch=tokens // long, seq_len=long)
    denom = r1 / short - r2 / long
    overhead = max(0.0, (r2 - r1) / denom) if denom > 0 else 0.0
    return {"attention_flops": r1 * (short + overhead) / short, "attention_block_overhead": overhead,
            "attention_points": [[short, r1], [long, r2]]}


def measure_step_overhead(*, repeats: int = 9) -> float:
    """Seconds of a training step that computes almost nothing (a 2-layer model of width 64 on 16 tokens:
    forward, backward, gradient clipping, AdamW, zero_grad), the median of `repeats` after two untimed:
    the framework's fixed work per step (Python, dispatch, the optimizer's per-tensor loops), which the
    FLOP and byte counts of the cost model do not see."""
    import statistics

    import torch
    import torch.nn.functional as F

    from meshlm.config import ModelConfig
    from meshlm.models.transformer import Transformer

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                      intermediate_size=128, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    times = []
    for i in range(repeats + 2):
        t = time.perf_counter()
        F.cross_entropy(model(x).view(-1, cfg.vocab_size), x.view(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def emulated_machine() -> dict:
    """`_machine()` and the fixed cost of a step (`measure_step_overhead`), alone on the cores: what
    `emulated_calibration` scales to the ranks sharing them."""
    return {**_machine(), "step_overhead_s": measure_step_overhead()}


def _cpu_cores() -> int:
    """Cores this process may run on (what local ranks share), not the host's total."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _time_collectives(rank: int, group, members: list[int], repeats: int, sizes=SIZES, *,
                      world_sync: bool = False, busy=None, kinds=None) -> dict:
    """Time each collective over message sizes on `group` (this rank one of `members`): {kind: [[bytes, s]]}.

    Default: the median of `repeats` runs of BACK_TO_BACK calls one after another, each run's mean call (a run
    after a barrier of the group), as a model's layers issue them: a call then also pays its peers' wake-up,
    which the fastest call after a barrier (every rank ready and spinning) hides -- a 4 KiB all-reduce of two
    gloo ranks on a 2-core host took 0.21 ms at its fastest after a barrier and 0.72-0.93 ms back to back.
    `world_sync`: each call after a barrier of the whole world, so that every group of a tier runs at once,
    sharing the node links and the cores as a step's groups do; the median call is kept, each timed from
    the last rank's arrival to the last rank's exit. Every rank of the world must call it then.
    `busy` (with world_sync; a function computing a slice): every rank computes a slice between the barrier
    and the call, as a training step does between collectives -- the call then also waits for peers that
    are still computing or descheduled."""
    import statistics

    import torch
    import torch.distributed as dist

    world = len(members)
    first, second = members[0], members[1]
    results: dict = {}
    for nbytes in sizes:
        n = nbytes // 4
        n -= n % world
        buf = torch.ones(n)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        ops = {
            "all_reduce": lambda: dist.all_reduce(buf, group=group),
            "all_gather": lambda: all_gather(torch.empty(n), buf[: n // world], group=group),
            "reduce_scatter": lambda: reduce_scatter(torch.empty(n // world), buf, group=group),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty(n), buf, group=group),
            # timed where it ends: a send returns once the kernel's socket buffers (megabytes) hold the data
            "p2p": ((lambda: dist.recv(buf, second, group=group)) if rank == first
                    else (lambda: dist.send(buf, first, group=group))),
        }
        for name, fn in ops.items():
            if kinds is not None and name not in kinds:
                continue
            if name == "p2p" and rank not in (first, second):
                if not world_sync:
                    continue
                fn = _idle  # still in the world's barriers
            try:
                fn()  # warm-up
                times, spans = [], []
                for _ in range(repeats):
                    if world_sync:
                        dist.barrier()
                        if busy is not None:
                            busy()
                    elif name != "p2p":
                        dist.barrier(group=group)
                    calls = 1 if world_sync else BACK_TO_BACK
                    t = time.monotonic()
                    for _ in range(calls):
                        fn()
                    spans.append((t, time.monotonic()))
                    times.append((spans[-1][1] - t) / calls)
                if world_sync and busy is None:
                    # Ranks leave a collective at different times (in gloo's ring over nodes, 100 ms apart
                    # for 5 MB at 100 Mbit/s), and whatever comes next waits for the last: time it from the
                    # last rank's arrival to the last rank's exit (one host: one monotonic clock).
                    everyone = [None] * dist.get_world_size()
                    dist.all_gather_object(everyone, spans)
                    times = [max(r[i][1] for r in everyone if r) - max(r[i][0] for r in everyone if r)
                             for i in range(repeats)]
                results.setdefault(name, []).append([n * 4, statistics.median(times)])
            except RuntimeError as e:  # an op the backend lacks: record and go on
                results.setdefault("unsupported", []).append(f"{name}: {str(e)[:80]}")
    return results


def _idle() -> None:
    pass


def tier_sizes(rate_bps: float, procs_per_node: int, *, seconds: float = 0.4) -> tuple:
    """Message sizes to time on an emulated cluster: SIZES, the largest ones cut where one rank's share of
    its node's link would take over `seconds` (a 4 MiB all-reduce takes seconds at tens of Mbit/s): 16 and
    64 KiB (the per-call costs) and the largest that fits, which sets the bandwidth (`_marginal_fit`): large
    enough that the token bucket's burst (tens of KiB through at once) is a small part of it."""
    cap = max(2**18, rate_bps / 8 / procs_per_node * seconds)
    sizes = [b for b in (2**14, 2**16, 2**18, 2**19, 2**20, 2**21, 2**22) if b <= cap]
    return tuple(sizes[:2] + sizes[-1:])


def _rank_main(rank: int, world: int, port: int, out_dir: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = _time_collectives(rank, None, list(range(world)), repeats)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_dir, "rank0.json").write_text(json.dumps(results))


BUSY_SLICE_FLOPS = 2e8  # compute between two timed collectives: ~2-3 ms of one core, a small layer's matmuls


def _busy_slice(flops: float = BUSY_SLICE_FLOPS):
    """A function computing `flops` of fp32 matmuls (256 x 256 blocks), as a rank between two collectives."""
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    count = max(1, round(flops / (2 * 256**3)))

    def run() -> None:
        for _ in range(count):
            torch.mm(a, b)

    return run


def measure_contention(rank: int, world: int, *, slices: int = 60, rounds: int = 2) -> dict:
    """How much slower a rank computes while every rank of this host computes than alone: the seconds of
    `slices` compute slices on rank 0 alone (the others blocked in a barrier) and on every rank at once
    (the mean over ranks), `rounds` times alternately, the median of each. Every rank must call it; all
    get the result."""
    import statistics

    import torch.distributed as dist

    work = _busy_slice()
    work()
    alone, together = [], []
    for _ in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            for _ in range(slices):
                work()
        mine_alone = time.perf_counter() - t
        dist.barrier()
        t = time.perf_counter()
        for _ in range(slices):
            work()
        mine = time.perf_counter() - t
        everyone = [None] * world
        dist.all_gather_object(everyone, [mine_alone, mine])
        alone.append(everyone[0][0])
        together.append(statistics.mean(m for _, m in everyone))
    a, t = statistics.median(alone), statistics.median(together)
    return {"alone_s": a, "together_s": t, "ranks": world, "slowdown": t / a}


def measure_tiers(rank: int, world: int, *, procs_per_node: int, repeats: int = 5, sizes=SIZES,
                  kinds=None, busy_repeats: int = 7) -> dict:
    """On an initialised default group of `world` ranks, `procs_per_node` consecutive ranks per emulated node:
    the collectives timed inside a node ("scale-up", every node's ranks at once; absent with one rank per
    node), across nodes ("scale-out", one rank per node, every rank of a node at once) and over all the
    ranks ("flat", absent with one rank per node), all groups of a tier started together
    (`_time_collectives(world_sync=True)`), over `sizes`: what the links give. And,
    as "<tier> busy", the smallest size again after a slice of compute on every rank (`busy_repeats` calls):
    what a call also waits for busy peers sharing the cores, as in training. Also "contention"
    (`measure_contention`). Every rank must call it; rank 0's points are returned (the others get {})."""
    import torch.distributed as dist

    nodes = world // procs_per_node
    assert nodes * procs_per_node == world and nodes >= 2
    node_groups = [list(range(n * procs_per_node, (n + 1) * procs_per_node)) for n in range(nodes)]
    rails = [list(range(j, world, procs_per_node)) for j in range(procs_per_node)]
    # new_group is collective over the whole world: every rank creates every group, in the same order.
    node_pgs = [dist.new_group(g) for g in node_groups] if procs_per_node > 1 else []
    rail_pgs = [dist.new_group(g) for g in rails]
    out: dict = {"contention": measure_contention(rank, world)}
    busy = _busy_slice()
    node, j = rank // procs_per_node, rank % procs_per_node
    tiers = [("scale-out", rail_pgs[j], rails[j])]
    if procs_per_node > 1:
        # one ring over every rank, node after node: gloo's flat ring, each node's link crossed once each way
        tiers = [("scale-up", node_pgs[node], node_groups[node]), *tiers, ("flat", None, list(range(world)))]
    for tier, pg, members in tiers:
        # the flat ring: the ring collectives only (collectives.collective_time prices those on it)
        tier_kinds = ([k for k in (kinds or RING_KINDS) if k in RING_KINDS] if tier == "flat" else kinds)
        out[tier] = _time_collectives(rank, pg, members, repeats, sizes, world_sync=True, kinds=tier_kinds)
        out[f"{tier} busy"] = _time_collectives(rank, pg, members, busy_repeats, sizes[:1], world_sync=True,
                                                busy=busy, kinds=tier_kinds)
    dist.barrier()
    for pg in (*node_pgs, *rail_pgs):
        dist.destroy_process_group(pg)
    return out if rank == 0 else {}


def _fit(points: list, factor: float) -> tuple[float, float]:
    """Least-squares `t = latency + factor * bytes / bandwidth` over (bytes, t) points."""
    xs = [factor * b for b, _ in points]
    ys = [t for _, t in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 1e-15)
    latency = max(0.0, my - slope * mx)
    return latency, 1.0 / slope


def _machine() -> dict:
    """What one core of this host computes and streams (the ranks run one thread each)."""
    attention = fit_attention()
    data: dict = {"device": "cpu", "matmul_flops": measure_matmul(), **attention,
                  **measure_gemm_weight_pass(),
                  "memory_bandwidth": measure_memory_bandwidth(), "cpu_cores": _cpu_cores(),
                  "serving_host": measure_serving_host()}
    try:
        data["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        data["memory_bytes"] = 16 * 2**30
    return data


def _marginal_fit(points: list, factor: float) -> tuple[float, float]:
    """`t = latency + factor * bytes / bandwidth` with the bandwidth of the smallest and the largest
    message's difference -- far apart, so that noise in either moves it little, and not pulled up by the
    middle sizes that a shaped link's token bucket lets through at once -- and the latency the median of
    what the points take beyond it."""
    import statistics

    (b1, t1), (b2, t2) = min(points), max(points)
    slope = (t2 - t1) / (factor * (b2 - b1)) if b2 > b1 else 0.0
    if slope <= 0:  # noise larger than the largest message's time: the least-squares fit
        return _fit(points, factor)
    latency = max(0.0, statistics.median(t - factor * b * slope for b, t in points))
    return latency, 1.0 / slope


def _fits(raw: dict, n: int, *, busy: dict | None = None) -> dict:
    """Per-collective `latency + factor * bytes / bandwidth` fits of one group size n (`_marginal_fit`: over
    sizes three orders of magnitude apart a least-squares fit follows the largest messages' milliseconds and
    put a 4 KiB all-reduce's latency at 0.97 ms where it took 0.3 ms; a fit in relative error got the latency
    but halved the 4 MiB bandwidth, which the training side's buckets ride). `busy`: the same
    collectives timed after a slice of compute on every rank ({kind: [[bytes, s]]}); what they took beyond
    the fit, the median over kinds, is written to every fit as "call_overhead" (seconds per call: the wait
    for busy peers, paid once per collective whatever its hops)."""
    import statistics

    ring = (n - 1) / n
    factors = {"all_reduce": 2 * ring, "all_gather": ring, "reduce_scatter": ring, "all_to_all": ring, "p2p": 1.0}
    fits = {}
    for name, pts in raw.items():
        if name in factors and len(pts) >= 2:
            lat, bw = _marginal_fit(pts, factors[name])
            fits[name] = {"latency": lat, "bandwidth": bw, "points": pts}
    extra = [t - (fits[k]["latency"] + factors[k] * b / fits[k]["bandwidth"])
             for k, pts in (busy or {}).items() if k in fits for b, t in pts]
    if extra:
        for fit in fits.values():
            fit["call_overhead"] = max(0.0, statistics.median(extra))
    return fits


def _link(fits: dict, n: int) -> dict:
    # The cost model has one default link per tier; use the all-reduce fit (gradient sync dominates CPU
    # runs), its latency counted per ring hop as collective_time does.
    ref = fits.get("all_reduce") or next(iter(fits.values()))
    return {"bandwidth": ref["bandwidth"], "latency": ref["latency"] / max(1, 2 * (n - 1))}


def calibrate(out: str | Path, *, world_size: int = 2, repeats: int = 5) -> dict:
    """Measure and write the calibration file; return its contents."""
    import torch.multiprocessing as mp

    if world_size < 2:
        raise ValueError(f"world_size={world_size} must be >= 2 to time collectives")
    data = _machine()
    data["world_size"] = world_size
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(world_size, free_port(), tmp, repeats), nprocs=world_size,
                           join=True, start_method="spawn")
        raw = json.loads(Path(tmp, "rank0.json").read_text())
    fits = _fits(raw, world_size)
    data["collectives"] = fits
    if "unsupported" in raw:
        data["unsupported"] = raw["unsupported"]
    data["link"] = _link(fits, world_size)
    Path(out).write_text(json.dumps(data, indent=2))
    return data


def emulated_calibration(tiers: dict, *, nodes: int, procs_per_node: int, rate_bps: float,
                         latency_s: float = 0.0, machine: dict | None = None) -> dict:
    """The calibration file's contents from `measure_tiers`' points (and `_machine()` unless given).

    The cost model takes one core's rates and divides them by share = ranks / cores where ranks time-share
    the cores (placement.rank_setup), the scale-up link's bandwidth too. What `measure_tiers` measured
    among busy ranks already is what a rank gets, so it is written per core: the scale-up fits' bandwidth
    x share, and the compute rates (`machine`, measured alone) x share / the measured slowdown of compute
    when every rank computes at once (2 for 4 ranks on 2 idle cores; more when other work shares them).
    The division then gives back what was measured. The fixed seconds of a step (`step_overhead_s`, from
    `emulated_machine`) are multiplied by that slowdown. The figures alone are kept under "alone"."""
    data = dict(machine) if machine is not None else _machine()
    world = nodes * procs_per_node
    cores = int(data.get("cpu_cores", 0))
    share = max(1.0, world / cores) if cores else 1.0
    out_fits = _fits(tiers["scale-out"], nodes, busy=tiers.get("scale-out busy"))
    # One rank per node: no scale-up link to time; the loopback is never the bottleneck then (unused).
    up_fits = (_fits(tiers["scale-up"], procs_per_node, busy=tiers.get("scale-up busy")) if "scale-up" in tiers
               else out_fits)
    if "scale-up" in tiers:
        for fit in up_fits.values():
            fit["bandwidth"] *= share
    # The world's ring: its bandwidth is that of a node-crossing hop (collectives.collective_time).
    flat = _fits(tiers["flat"], world, busy=tiers.get("flat busy")) if "flat" in tiers else None
    contention = tiers.get("contention")
    if contention:
        scale = share / max(1.0, contention["slowdown"])
        data["alone"] = {k: data[k] for k in ("matmul_flops", "attention_flops", "memory_bandwidth",
                                              "step_overhead_s") if k in data}
        data.update({k: v * scale for k, v in data["alone"].items() if k != "step_overhead_s"})
        if "step_overhead_s" in data:  # seconds, as they are while every rank computes
            data["step_overhead_s"] *= max(1.0, contention["slowdown"])
        data["contention"] = contention
    data.update(world_size=procs_per_node, collectives=up_fits, link=_link(up_fits, procs_per_node),
                scale_out={"world_size": nodes, "collectives": out_fits, "link": _link(out_fits, nodes)},
                **({"flat": {"world_size": world, "collectives": flat}} if flat else {}),
                emulated={"nodes": nodes, "procs_per_node": procs_per_node, "inter_node_bw_bps": rate_bps,
                          "inter_node_latency_s": latency_s})
    return data


def _emulated_rank(index: int, namespaces: list, address: str, port: int, procs_per_node: int, out_dir: str,
                   repeats: int, sizes: tuple) -> None:
    import torch
    import torch.distributed as dist

    from meshlm.emulate import IFNAME, enter_node

    enter_node(namespaces[index // procs_per_node])
    os.environ["GLOO_SOCKET_IFNAME"] = IFNAME  # torch's setting: gloo on the node's link
    torch.set_num_threads(1)
    world = len(namespaces) * procs_per_node
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=index, world_size=world)
    try:
        tiers = measure_tiers(index, world, procs_per_node=procs_per_node, repeats=repeats, sizes=sizes)
    finally:
        dist.destroy_process_group()
    if index == 0:
        Path(out_dir, "tiers.json").write_text(json.dumps(tiers))


def calibrate_emulated(out: str | Path, *, nodes: int, procs_per_node: int, rate_bps: float,
                       latency_s: float = 0.0, repeats: int = 5) -> dict:
    """Create an emulated cluster (`meshlm.emulate`), fit both link tiers on it, write and return the file
    that `--cluster local --calibration OUT` reads as a two-tier cluster."""
    import torch.multiprocessing as mp

    from meshlm.emulate import EmulatedCluster

    if procs_per_node < 1:
        raise ValueError(f"procs_per_node={procs_per_node} must be >= 1")
    with EmulatedCluster(nodes=nodes, rate_bps=rate_bps, latency_s=latency_s) as cluster, \
            tempfile.TemporaryDirectory() as tmp:
        machine = emulated_machine()  # before the ranks start: alone on the cores
        # A fresh namespace listens on no port: the rendezvous may take a fixed one.
        mp.start_processes(_emulated_rank, args=(cluster.namespaces, cluster.addresses[0], 29500, procs_per_node,
                                                 tmp, repeats, tier_sizes(rate_bps, procs_per_node)),
                           nprocs=nodes * procs_per_node, join=True, start_method="spawn")
        tiers = json.loads(Path(tmp, "tiers.json").read_text())
    data = emulated_calibration(tiers, nodes=nodes, procs_per_node=procs_per_node, rate_bps=rate_bps,
                                latency_s=latency_s, machine=machine)
    Path(out).write_text(json.dumps(data, indent=2))
    return data
