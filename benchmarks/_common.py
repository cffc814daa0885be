"""Shared machinery of the side-by-side benchmarks `zero.py` and `tp.py` (not a benchmark itself).

Responsible for: the command-line options both share, the model and the batches, starting the ranks
(spawned processes, one intra-op thread each, gloo on CPU / NCCL on CUDA, one GPU per rank) and
collecting rank 0's result, timing two implementations in alternation, the one extra, untimed step
per implementation that measures its peak memory and the bytes its collectives moved, and the
JSON they print.
Also: every benchmark's `--smoke` (`parse_args_smoke`: the smallest sizes for one or two steps, the same code
paths) and the JSON a smoke run prints instead where this host lacks what a benchmark needs (`missing_extras`,
`print_smoke_skip`), and how a benchmark sets the planner's prediction beside its measurement
(`predicted_vs_measured`: one direction, predicted / measured, for every benchmark); for the benchmarks that set
the serving planner beside meshlm's engine, stepping the engine with timings (`stepped_generate`, `single_and_batch`)
and pricing the same runs on this machine (`meshlm_on_this_machine`, `static_batches_vs`, `local_cluster_json`).
Not responsible for: building the implementations or their training steps (each benchmark does).

How memory is counted. `torch.distributed._tools.mem_tracker.MemTracker` (a TorchDispatchMode that
PyTorch ships for this purpose) is told about this implementation's long-lived tensors (model
parameters, optimizer state, plus any extra buffers the benchmark names), then sees every tensor
created during one training step and every `UntypedStorage.resize_` (how meshlm ZeRO-3 and FSDP2
free and refill full parameters). The peak is the largest sum of the sizes of the live storages at
any point of the step: parameters + gradients + optimizer state + activations saved for backward +
temporaries + communication buffers. The same counter runs for every implementation, on CPU and
CUDA (on CUDA each storage is rounded up to the allocator's 512-byte blocks); it is not what the
allocator reserves.

How communication is counted. A second TorchDispatchMode sees every collective dispatched during the
same step -- the in-place `c10d::*` ops behind `torch.distributed.*` (meshlm's `comm.py`, FSDP2) and
the functional `_c10d_functional::*` ops (DTensor) alike -- and adds their bytes with meshlm's
`CommStats` convention: all-gather counts its output, reduce-scatter and all-to-all their input,
all-reduce and broadcast the tensor. Barriers are not counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshlm.config import ModelConfig
from meshlm.processes import cpu_seconds, descendants, free_port


SMOKE_HELP = ("smoke test: the same code paths at the smallest sizes, one or two steps, still printing the JSON; "
              "where this host lacks what the benchmark needs, a JSON saying what was skipped and why (exit 0)")
# zero.py, tp.py, ep.py, pp.py: a 1-layer model of hidden 32 on 2 ranks, one timed step, no warmup
SMOKE_MODEL = dict(world_sizes="2", steps=1, warmup=0, hidden=32, layers=1, heads=4, kv_heads=2, vocab=64,
                   seq_len=16, batch=2)


def parse_args_smoke(ap: argparse.ArgumentParser, smoke: dict, argv=None) -> argparse.Namespace:
    """Add --smoke and parse. With --smoke, `smoke` replaces the defaults (options given explicitly still win)."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**smoke)
        args = ap.parse_args(argv)
    return args


def predicted_vs_measured(pairs: dict[str, tuple]) -> dict:
    """{name: {"predicted", "measured", "ratio"}} for each `name: (predicted, measured)` of `pairs` whose figures
    are both there and nonzero; ratio = predicted / measured (above 1: the planner is slower than the run, below
    1: faster), the one direction every benchmark prints."""
    return {name: {"predicted": float(f"{p:.4g}"), "measured": m, "ratio": round(p / m, 3)}
            for name, (p, m) in pairs.items() if p and m}


def meshlm_on_this_machine(cfg: ModelConfig | str, calibration: str | None):
    """`meshlm plan infer --cluster local --engine meshlm` of `cfg` (a `ModelConfig`, or a saved model's directory or
    config.json; fp32 weights and KV, one rank) from a `meshlm plan
    calibrate` file, as the benchmarks that set the planner beside meshlm's engine price it: (the `Serving`, None), or
    (None, the JSON of why the planner part is skipped: no file, or one older than the engine's host timing)."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.serving import Serving
    from meshlm.planner.serving_engine import engine
    from meshlm.planner.serving_layout import ServingLayout
    from meshlm.planner.serving_model import served_model

    if not calibration or not os.path.exists(calibration):
        return None, {"skipped": f"no calibration file {calibration!r}: run `meshlm plan calibrate --out FILE` and "
                                 "pass --calibration FILE"}
    cluster = get_cluster("local", calibration=calibration)
    if not cluster.serving_host:
        return None, {"skipped": f"{calibration!r} predates the engine's host timing (serving_host): rerun `meshlm "
                                 "plan calibrate`"}
    return Serving(served_model(cfg), cluster, ServingLayout(), precision="fp32", kv_precision="fp32",
                   engine=engine("meshlm", cluster)), None


def stepped_generate(engine, prompts: list[list[int]], output_len: int):
    """`LLM.generate`'s loop (every prompt submitted at once, steps until all finish), timing each request's first
    token (TTFT: from the submission) and the mean time between its later tokens (TPOT). Returns (seconds, TTFTs,
    TPOTs, token ids in prompt order, this process's CPU seconds over the wall seconds: the share of a core it got,
    below 1 where other work on the host took the rest, or where it waited for other ranks; the cores other work
    took meanwhile, `OtherWork` over every rank, all spawned by the benchmark's process)."""
    from meshlm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with OtherWork(os.getppid()) as other:  # the ranks: spawned by the benchmark's process
        cpu, start = time.process_time(), time.perf_counter()
        ids = [engine.add_request(p, params).request_id for p in prompts]
        first, final = {}, {}
        while len(final) < len(ids):
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                if out.finished:
                    final[out.request_id] = (now, out.token_ids)
        seconds = time.perf_counter() - start
        share = (time.process_time() - cpu) / seconds
    ttft = [first[i] - start for i in ids]
    tpot = [(final[i][0] - first[i]) / max(1, len(final[i][1]) - 1) for i in ids]
    return seconds, ttft, tpot, [final[i][1] for i in ids], share, other.cores


def single_and_batch(engine, fresh, *, output_len: int, repeats: int, batch: int) -> dict:
    """One request at a time (`repeats` of them, each prompt from `fresh()`; the fastest counts, timeit's rule) and a
    static batch of `batch` requests submitted at once, stepped by `stepped_generate`: {"single": TTFT and TPOT,
    "batch": output tokens/s, mean TTFT and TPOT}, in ms."""
    single = min((stepped_generate(engine, [fresh()], output_len) for _ in range(repeats)), key=lambda r: r[0])
    runs = stepped_generate(engine, [fresh() for _ in range(batch)], output_len)
    return {"single": {"ttft_ms": round(1e3 * single[1][0], 3), "tpot_ms": round(1e3 * single[2][0], 3)},
            "batch": {"requests": batch, "tokens_per_s": round(batch * output_len / runs[0], 1),
                      "ttft_mean_ms": round(1e3 * sum(runs[1]) / len(runs[1]), 3),
                      "tpot_mean_ms": round(1e3 * sum(runs[2]) / len(runs[2]), 3)}}


def static_batches_vs(sv, measured: dict, workload) -> dict:
    """The planner's static batches of one request and of the batch `single_and_batch` measured, each priced as
    `workload(batch)` (a `Workload`) on `sv`, predicted / measured: TTFT, TPOT, and the batch's output tokens/s."""
    from meshlm.planner.serving_modes import estimate_serving

    out = {}
    for part, m in measured.items():
        batch = m.get("requests", 1)
        est = estimate_serving(sv, workload(batch))
        out[part] = predicted_vs_measured(
            {"ttft_ms": (est["ttft_ms"], m.get("ttft_ms", m.get("ttft_mean_ms"))),
             "tpot_ms": (est["tpot_ms"], m.get("tpot_ms", m.get("tpot_mean_ms"))),
             **({"output_tokens_per_s": (est["output_tokens_per_s"], m["tokens_per_s"])} if batch > 1 else {})})
    return out


def local_cluster_json(cluster) -> dict:
    """What the planner parts print of the `--cluster local` they priced on."""
    return {"matmul_flops": cluster.peak("fp32"), "cores": cluster.compute_slots,
            "serving_host_s": cluster.serving_host}


def missing_extras(*modules: str) -> list[str]:
    """The modules of `modules` that are not installed (an optional extra of meshlm's)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def print_result(result: dict, args, started: float, *, smoke_skipped: dict[str, str] | None = None) -> None:
    """A benchmark's JSON, ended as they all end it: "wall_seconds" since `started` (perf_counter), then under --smoke
    "smoke" and what the smoke run left out ("skipped", when `smoke_skipped` names any)."""
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    if args.smoke:
        result["smoke"] = True
        if smoke_skipped is not None:
            result["skipped"] = smoke_skipped
    print(json.dumps(result, indent=2))


def print_smoke_skip(benchmark: str, skipped: dict[str, str], **extra) -> None:
    """The JSON of a smoke run that could not run (part of) its benchmark here: what was skipped, and why."""
    print(json.dumps({"benchmark": benchmark, "smoke": True, "skipped": skipped, **extra}, indent=2))


def smoke_cuda_missing(args) -> str | None:
    """Why a smoke run with --device cuda cannot run here (None where it can)."""
    if args.device == "cuda" and torch.cuda.device_count() < max(int(s) for s in str(args.world_sizes).split(",")):
        return f"--device cuda needs one GPU per rank; this machine has {torch.cuda.device_count()}"
    return None


def add_common_args(ap: argparse.ArgumentParser, *, world_sizes: str) -> None:
    ap.add_argument("--world-sizes", default=world_sizes,
                    help="comma-separated numbers of ranks, one run each (default %(default)s)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: gloo ranks with one thread each; cuda: one GPU per rank, NCCL")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed steps per implementation (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps per implementation before those (default %(default)s)")
    model = ap.add_argument_group("model (meshlm's reference Transformer; MLP width 3 x hidden)")
    model.add_argument("--hidden", type=int, default=256, help="hidden size (default %(default)s)")
    model.add_argument("--layers", type=int, default=4, help="transformer blocks (default %(default)s)")
    model.add_argument("--heads", type=int, default=4, help="attention heads (default %(default)s)")
    model.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    model.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default %(default)s)")
    model.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default %(default)s)")
    ap.add_argument("--batch", type=int, default=2,
                    help="sequences per step on each data-parallel rank (default %(default)s)")


def parse_world_sizes(args) -> list[int]:
    sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--world-sizes={args.world_sizes!r} must be comma-separated integers >= 1")
    if args.device == "cuda" and max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--world-sizes={args.world_sizes} needs {max(sizes)} GPUs (one per rank, NCCL); "
                         f"this machine has {torch.cuda.device_count()}")
    return sizes


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads, intermediate_size=3 * args.hidden,
                       max_seq_len=args.seq_len)


def batch(args, step: int, num_seqs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step`: `num_seqs` random sequences, as (inputs, targets), the same on every rank."""
    g = torch.Generator().manual_seed(step)
    seqs = torch.randint(0, args.vocab, (num_seqs, args.seq_len + 1), generator=g).to(device)
    return seqs[:, :-1], seqs[:, 1:]


def device_of(args, rank: int) -> torch.device:
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, port: int, fn, args, out_queue, release, before_init=None,
               master_addr: str = "127.0.0.1") -> None:
    if before_init is not None:
        before_init(rank)
    torch.set_num_threads(1)
    init = {"backend": "gloo"}
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        init = {"backend": "nccl", "device_id": torch.device("cuda", rank)}
    dist.init_process_group(init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=world_size, **init)
    try:
        result = fn(rank, world_size, args)
        if rank == 0:
            out_queue.put(result)
            out_queue.close()
            out_queue.join_thread()  # the result is in the pipe before this process can end
            # Rank 0 hosts the rendezvous store: it leaves only once every other rank has exited, so that no
            # rank's process group sees its store vanish while it is still tearing down.
            release.wait(timeout=120)
    finally:
        dist.destroy_process_group()
    # A finished rank ends here without running C++ static destructors: in a network namespace a rank was seen
    # to abort in them after its work was done ("terminate called without an active exception", no Python
    # frame), failing a run whose results were already in.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world_size: int, args, *, before_init: Callable | None = None,
              master_addr: str = "127.0.0.1") -> dict:
    """Run `fn(rank, world_size, args) -> dict` on `world_size` spawned ranks; return rank 0's dict.

    `fn` must be a module-level function (spawn pickles it by name). If a rank dies, all are killed.
    `before_init(rank)` runs in each rank before the process group (e.g. entering an emulated node,
    `meshlm.emulate.enter_node`), whose rendezvous is then at `master_addr`.
    """
    ctx = mp.get_context("spawn")
    out_queue = ctx.Queue()
    release = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world_size, port, fn, args, out_queue, release, before_init, master_addr))
             for r in range(world_size)]
    for p in procs:
        p.start()
    result = None
    while result is None:
        try:
            result = out_queue.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
    for p in procs[1:]:
        p.join()
    release.set()
    procs[0].join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return result


# --------------------------------------------------------------------------------------------
# The host's cores (stopping the servers a benchmark started: meshlm.processes.stop_tree)
# --------------------------------------------------------------------------------------------


def host_busy_seconds() -> float:
    """CPU seconds every core of the host has spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class OtherWork:
    """The cores other work on the host took while a block ran: the host's busy CPU seconds less those of
    `ours` (the process `root` and the ones below it: a benchmark's ranks), over the block's wall seconds.
    `root_is_other`: `root` itself counts as other work, only the processes below it as ours (a benchmark whose own
    process is the client of a server it started: the client's CPU is taken from the server's cores).
    `cores` (after the block): None where /proc is missing or the block was shorter than `min_s` (/proc/stat
    counts clock ticks, 10 ms each). On a host whose cores the run shares, the cores left to it are its cores
    less these."""

    def __init__(self, root: int, *, min_s: float = 0.25, root_is_other: bool = False):
        self.root, self.min_s, self.cores, self.root_is_other = root, min_s, None, root_is_other

    def _ours(self) -> float:
        return cpu_seconds([*([] if self.root_is_other else [self.root]), *descendants(self.root)])

    def __enter__(self):
        try:
            self._start = (time.perf_counter(), host_busy_seconds(), self._ours())
        except (OSError, ValueError):
            self._start = None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            wall, busy, ours = self._start
            elapsed = time.perf_counter() - wall
            if elapsed >= self.min_s:
                self.cores = max(0.0, (host_busy_seconds() - busy - (self._ours() - ours)) / elapsed)
        return False


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_alternating(steps: dict[str, Callable[[int], torch.Tensor]], *, warmup: int, timed: int,
                     device: torch.device) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Run step i of every implementation, for i in range(warmup + timed), alternating which goes
    first, so that load from other processes on the host hits all alike. Every step starts after a
    barrier; its time is that of the slowest rank (one all-reduce after the loop).

    `steps[name](i)` runs training step i (the same batch for every implementation) and returns this
    rank's loss as a detached scalar tensor. Returns, per name, the seconds of each timed step and
    this rank's losses of every step stacked in one tensor.
    """
    names = list(steps)
    seconds = {n: [] for n in names}
    losses = {n: [] for n in names}
    for i in range(warmup + timed):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            loss = steps[name](i)
            synchronize(device)
            if i >= warmup:
                seconds[name].append(time.perf_counter() - start)
            losses[name].append(loss)
    for name in names:
        slowest = torch.tensor(seconds[name], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds[name] = slowest.tolist()
        losses[name] = torch.stack(losses[name])
    return seconds, losses


# --------------------------------------------------------------------------------------------
# Peak memory and bytes moved, over one untimed step
# --------------------------------------------------------------------------------------------


def _collective_kind(name: str) -> str | None:
    """'all_gather' etc. for a c10d / functional collective op name, None for anything else."""
    ns, _, op = name.partition("::")
    if ns not in ("c10d", "_c10d_functional"):
        return None
    flat = op.replace("_", "")
    for kind, key in (("all_gather", "allgather"), ("reduce_scatter", "reducescatter"),
                      ("all_reduce", "allreduce"), ("all_to_all", "alltoall"), ("broadcast", "broadcast"),
                      ("send", "send"), ("recv", "recv")):
        if flat.startswith(key):
            return kind
    return None  # barrier, wait_tensor, _wrap_tensor_autograd, ...


def _nbytes(tree) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Bytes and calls of every collective dispatched while active, per kind (meshlm's convention)."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower to plain-tensor ops first
        out = func(*args, **(kwargs or {}))
        kind = _collective_kind(func._schema.name)
        if kind is not None:
            functional = func._schema.name.startswith("_c10d_functional")
            if kind == "all_gather":
                counted = out if functional else args[0]  # the output
            elif kind in ("reduce_scatter", "all_to_all") and not functional:
                counted = args[1]  # (output, input, ...): the input
            else:
                counted = args[0]
            self.bytes[kind] += _nbytes(counted)
            self.calls[kind] += 1
        return out


def measure_step(step: Callable[[], object], externals: Iterable, device: torch.device) -> dict:
    """Run `step()` once under the memory tracker and the collective counter (see the module docstring).

    `externals`: the modules, optimizers and tensors this implementation holds between steps.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    dist.barrier()
    tracker, counter = MemTracker(), CollectiveCounter()
    tracker.track_external(*externals)
    with warnings.catch_warnings():
        # The tracker's gradient hooks also fire for gradients a sharded strategy has already
        # handed over (`.grad` is None by then); it warns about those and counts nothing.
        warnings.simplefilter("ignore")
        with tracker, counter:
            step()
        synchronize(device)
    peak_snap = {}  # MemTracker's own categories at the moment of the peak (Total among them)
    for dev, snap in tracker.get_tracker_snapshot("peak").items():
        if torch.device(dev).type == device.type:
            for kind, nbytes in snap.items():
                kind = getattr(kind, "value", kind)  # an enum of MemTracker's, or "Total"
                peak_snap[kind] = peak_snap.get(kind, 0) + nbytes
    return {"peak_memory_bytes": peak_snap.get("Total", 0),
            "peak_memory_by_kind": {k: v for k, v in peak_snap.items() if k != "Total" and v},
            "bytes_moved_per_step": sum(counter.bytes.values()),
            "bytes_moved_by_op": dict(counter.bytes), "collective_calls_by_op": dict(counter.calls)}


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def compare(steps: dict[str, Callable[[int], torch.Tensor]], externals: dict[str, tuple], *, args,
            device: torch.device, ours_stats, sum_losses_over_ranks: bool) -> dict:
    """Time the implementations (`time_alternating`), then measure each over one more step
    (`measure_step`); the JSON block: a row per implementation and the ratios ours / peer.

    `steps` holds two entries, ours first; `externals[name]` what `measure_step` needs; `ours_stats`
    meshlm's `CommStats`, whose total over the measured step is reported next to the counter's.
    `sum_losses_over_ranks`: each rank returns its share of the global loss (data parallelism), so
    the reported loss is their sum; otherwise every rank returns the whole loss.
    """
    ours, peer = steps
    seconds, losses = time_alternating(steps, warmup=args.warmup, timed=args.steps, device=device)
    rows = {}
    for name, step in steps.items():
        ours_stats.reset()
        rows[name] = measure_step(lambda: step(args.warmup + args.steps), externals[name], device)
        if name == ours:
            rows[name]["commstats_bytes_per_step"] = ours_stats.total().bytes
        if sum_losses_over_ranks:
            dist.all_reduce(losses[name])
        rows[name] |= {"step_ms_median": round(statistics.median(seconds[name]) * 1e3, 2),
                       "step_ms_min": round(min(seconds[name]) * 1e3, 2),
                       "loss_step1": losses[name][0].item(), "loss_last_timed_step": losses[name][-1].item()}
    a, b = rows[ours], rows[peer]
    return {ours: a, peer: b,
            "step_time_ratio": _ratio(a["step_ms_median"], b["step_ms_median"]),
            "step_time_ratio_of_min": _ratio(a["step_ms_min"], b["step_ms_min"]),
            "peak_memory_ratio": _ratio(a["peak_memory_bytes"], b["peak_memory_bytes"]),
            "bytes_moved_ratio": _ratio(a["bytes_moved_per_step"], b["bytes_moved_per_step"]),
            "loss_step1_abs_diff": abs(a["loss_step1"] - b["loss_step1"])}


def print_results(benchmark: str, args, results: list[dict]) -> None:
    print(json.dumps({"benchmark": benchmark, "smoke": args.smoke, "device": args.device,
                      "backend": "nccl" if args.device == "cuda" else "gloo",
                      "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                                "kv_heads": args.kv_heads, "vocab": args.vocab, "seq_len": args.seq_len},
                      "batch": args.batch, "warmup_steps": args.warmup, "timed_steps": args.steps,
                      "results": results}, indent=2))
