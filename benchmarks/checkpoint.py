"""meshlm checkpoints: save, load and verification time, size on disk, peak memory per rank.

    python benchmarks/checkpoint.py                            # tiny model, 1 rank and 4 gloo ranks on CPU
    python benchmarks/checkpoint.py --large                    # + a ~100M-parameter model (several minutes)
    python benchmarks/checkpoint.py --layouts dp4,zero3 --repeats 3
    python benchmarks/checkpoint.py --smoke                    # a 1-layer model, single, once (CI)

--smoke: layout single of a 1-layer model of hidden 32 ("smoke" size), one save and one load (--repeats 1), a
16-token training step. Skips the sharded layouts (their save and load paths run in tests/test_checkpoint.py).

What runs. For every model size and layout, ranks are spawned (one intra-op thread each, gloo; see
benchmarks/_common.py) and every rank builds the model the way the trainer does:
`build_mesh(ParallelDims.from_config(parallel), device_type="cpu")`, `build_model`, `parallelize`,
`build_optimizer(model, TrainConfig(), zero=parallel_model.zero)` -- so ZeRO shards and tensor-parallel
slices are the real ones. One training step (one `--seq-len` sequence per data-parallel rank) fills the
optimizer state, then:
  save     `save_checkpoint` (every rank, with a barrier, as `Trainer.save`), `--repeats` times, timed
           from a barrier to the slowest rank; then once more, untimed, under the memory counters.
  verify   `verify_checkpoint(path)` (size + sha256 of every file) on rank 0 alone, as `check_run_dir`
           does once before a resume starts any rank.
  load     the trained model and optimizer are dropped; a fresh model + optimizer are built the same
           way (same layout, as a resume does) and `load_checkpoint(..., checksums=False)` loads into
           them (`Trainer.load` verifies first and then loads without checksums), `--repeats` times,
           timed like save; then once more under the memory counters. The loaded weights are compared
           with the saved ones (max abs difference over this rank's parameters, 0.0 expected).
  size     bytes on disk of the checkpoint directory: DCP files (model + optimizer), the safetensors
           weights (inference's copy), the rest (JSON).

Peak memory, per rank, over one save and one load call, three ways (none of them alone sees everything):
  memtracker   torch's MemTracker (as benchmarks/_common.measure_step, told about the model, optimizer
               and ZeRO shards): the peak sum of live tensor storages during the call (incl. those
               long-lived ones, `*_peak_bytes`) and that peak minus the storages live when the call
               began (`*_peak_over_start_bytes`). It sees every torch tensor (the gathered ZeRO / TP full
               tensors, the full optimizer state dict, the clones written as safetensors), not the bytes
               buffers DCP's writer, safetensors and pickle build outside torch.
  rss          the process's resident set high-water mark during the call minus its RSS when the call
               began (/proc/self/status VmHWM, reset through /proc/self/clear_refs): everything,
               including the allocator's and the page cache's effects, at page granularity.
  tracemalloc  Python heap (incl. bytes objects and numpy) peak during the call; torch storages are
               not in it. Run only in the measured call (it slows Python allocation down).

  async    `begin_save(..., asynchronous=True)` (what `train.async_checkpoint = true` blocks training for:
           staging this rank's pieces in CPU memory) and, separately, until `finish_save` has published.

Notes (also in the JSON): the synchronous save (`save_checkpoint`) blocks training for all of `save_s`;
the asynchronous one for `async_blocked_s`. Every rank writes only its own pieces (ZeRO ranges, TP/EP
shards; `meshlm.checkpoint.shards`), so a save's peak per rank follows its shard, not the model.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import parse_args_smoke, run_ranks
from meshlm.config import Config, ModelConfig, ParallelConfig, TrainConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.models.transformer import Transformer
from meshlm.parallel.parallelize import parallelize
from meshlm.parallel.tensor import vocab_parallel_cross_entropy
from meshlm.checkpoint import begin_save, finish_save, load_checkpoint, save_checkpoint, verify_checkpoint
from meshlm.train.optim import build_optimizer

# name -> (world size, ParallelConfig keywords)
LAYOUTS = {
    "single": (1, dict(dp_shard=1)),
    "dp4": (4, dict(dp_shard=4, zero_stage=0)),
    "zero3": (4, dict(dp_shard=4, zero_stage=3)),
    "tp2_dp2": (4, dict(dp_shard=2, tp=2)),
    "tp2_zero3": (4, dict(dp_shard=2, tp=2, zero_stage=3)),
}
SIZES = {  # name -> ModelConfig keywords (MLP width 3 x hidden, as the other benchmarks)
    "tiny": dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
    "smoke": dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=96),
    "100m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                 intermediate_size=2304),
}

NOTES = {
    "async_save": "async_blocked_s: begin_save(asynchronous=True), the part training waits for (the CPU staging copy of "
                  "this rank's pieces); async_total_s: until finish_save published it (nothing else runs meanwhile "
                  "here, so it is the background write's length, not training time lost)",
    "sharded_save": "every rank writes only its own pieces (meshlm.checkpoint.shards): ZeRO flat ranges and TP/EP shards "
                    "at their offsets; no rank gathers a full tensor, on save or load",
    "load": "load_checkpoint(checksums=False) into a fresh model + optimizer built the same way (as Trainer.load "
            "after saved_layout verified): DCP reads into this rank's pieces in place",
    "verify": "verify_checkpoint(path) on rank 0 alone: size + sha256 of every file (load_checkpoint's default "
              "checksums=True would add this to every rank's load)",
    "timing": "2 shared CPU cores, page cache not dropped: the first load after a build can be several times "
              "slower than the next (cold pages); look at every repeat, not the median alone",
    "memory": "memtracker: torch MemTracker, live tensor storages (not DCP/safetensors/pickle byte buffers); "
              "rss: VmHWM during the call minus VmRSS at its start (everything, page granularity; understates when "
              "memory freed by the timed repeats before is reused without new pages); tracemalloc: "
              "Python heap peak (not torch storages)",
}


# --------------------------------------------------------------------------------------------
# Memory counters
# --------------------------------------------------------------------------------------------


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def measure_call(fn, externals) -> dict:
    """Run `fn()` once under MemTracker, tracemalloc and the RSS high-water mark; the peaks (bytes)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    gc.collect()
    dist.barrier()
    tracker = MemTracker()
    tracker.track_external(*externals)
    hwm_ok = _reset_hwm()
    rss_start = _proc_status_kb("VmRSS") * 1024
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            start = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("current").values())
            tracemalloc.start()
            try:
                fn()
                _, py_peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    # the kernel updates VmHWM lazily: it can read a page or so below the RSS read at the start
    rss_peak = max(_proc_status_kb("VmHWM") * 1024, rss_start)
    peak = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    return {"memtracker_peak_bytes": peak, "memtracker_peak_over_start_bytes": peak - start,
            "rss_peak_over_start_bytes": rss_peak - rss_start if hwm_ok else None,
            "rss_start_bytes": rss_start, "rss_peak_bytes": rss_peak if hwm_ok else None,
            "tracemalloc_peak_bytes": py_peak}


# --------------------------------------------------------------------------------------------
# One layout
# --------------------------------------------------------------------------------------------


def _timed(fn) -> float:
    """Seconds of `fn()` from a barrier to the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _build(cfg: Config):
    mesh = build_mesh(ParallelDims.from_config(cfg.parallel), device_type="cpu")
    model = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    pm = parallelize(model, mesh, cfg.parallel, seq_len=cfg.train.seq_len)
    opt = build_optimizer(model, cfg.train, zero=pm.zero)
    externals = [model, opt] + ([part.param_shard for part in pm.zero.parts] if pm.zero is not None else [])
    return model, pm, opt, externals


def _train_step(model, pm, opt, cfg: Config) -> None:
    """One step (one sequence per data-parallel rank), so that the optimizer state exists."""
    g = torch.Generator().manual_seed(pm.dp_rank)
    seqs = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len + 1), generator=g)
    logits = pm.module(seqs[:, :-1])
    if pm.tensor_parallel:  # this rank's vocab slice of the logits
        loss = vocab_parallel_cross_entropy(logits, seqs[:, 1:], pm.mesh)
    else:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), seqs[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _params_copy(model, opt) -> dict:
    zero = getattr(opt, "zero", None)
    with zero.full_params() if zero is not None else contextlib.nullcontext():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _num_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


def _disk(path: Path) -> dict:
    sizes = {"dcp_bytes": 0, "safetensors_bytes": 0, "other_bytes": 0}
    files = 0
    for f in path.iterdir():
        if not f.is_file():
            continue
        files += 1
        n = f.stat().st_size
        key = "dcp_bytes" if f.suffix == ".distcp" or f.name == ".metadata" else \
            "safetensors_bytes" if f.suffix == ".safetensors" else "other_bytes"
        sizes[key] += n
    return {"total_bytes": sum(sizes.values()), **sizes, "files": files}


def _rank(rank: int, world_size: int, args) -> dict:
    size, layout, root = args.job
    parallel = ParallelConfig(**LAYOUTS[layout][1])
    model_cfg = ModelConfig(**SIZES[size], max_seq_len=args.seq_len)
    cfg = Config(model=model_cfg, parallel=parallel, train=TrainConfig(seq_len=args.seq_len, run_dir=str(root)))
    barrier = dist.barrier

    t0 = time.perf_counter()
    model, pm, opt, externals = _build(cfg)
    _train_step(model, pm, opt, cfg)
    setup_s = time.perf_counter() - t0
    # bytes this rank holds between steps: its parameters (a ZeRO-3 parameter's storage is freed: 0) and the
    # optimizer's tensors (AdamW moments; ZeroAdamW's flat master shard, its moments)
    local_param_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    local_optim_bytes = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                            if torch.is_tensor(t)) + sum(p.untyped_storage().nbytes() for p in externals[2:])

    def save(step: int):
        return save_checkpoint(root, step=step, model=model, optimizer=opt, config=cfg, rank_extra={"rank": rank},
                               rank=rank, world_size=world_size, keep=1, barrier=barrier, mesh=pm.mesh)

    save_s = [_timed(lambda i=i: save(i + 1)) for i in range(args.repeats)]
    group = dist.new_group(backend="gloo")  # as the trainer: the background writer's own group
    blocked_s, total_s = [], []
    for i in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        pending = begin_save(root, step=100 + i, model=model, optimizer=opt, config=cfg, rank_extra={"rank": rank},
                             rank=rank, world_size=world_size, keep=1, barrier=barrier, mesh=pm.mesh,
                             asynchronous=True, async_group=group)
        blocked_s.append(time.perf_counter() - start)
        finish_save(pending)
        total_s.append(time.perf_counter() - start)
    timings = torch.tensor([blocked_s, total_s], dtype=torch.float64)
    dist.all_reduce(timings, op=dist.ReduceOp.MAX)  # the slowest rank of each repeat
    blocked_s, total_s = timings.tolist()
    step = 200
    save_mem = measure_call(lambda: save(step), externals)
    path = root / "checkpoints" / f"step_{step:06d}"
    saved = _params_copy(model, opt)
    verify_s = None
    if rank == 0:
        start = time.perf_counter()
        verify_checkpoint(path)
        verify_s = time.perf_counter() - start
        disk = _disk(path)
    dist.barrier()

    # drop the trained model and optimizer, build fresh ones the same way
    del model, opt, externals, pm
    gc.collect()
    model, pm, opt, externals = _build(cfg)

    def load():
        load_checkpoint(path, model=model, optimizer=opt, config=cfg, rank=rank, mesh=pm.mesh, checksums=False)

    load_s = [_timed(load) for _ in range(args.repeats)]
    load_mem = measure_call(load, externals)
    loaded = _params_copy(model, opt)
    max_diff = max((saved[n] - loaded[n]).abs().max().item() for n in saved)

    mine = {"rank": rank, "local_param_bytes": local_param_bytes,
            "local_optimizer_bytes": local_optim_bytes, "setup_s": round(setup_s, 2),
            "save": save_mem, "load": load_mem, "max_abs_diff_loaded_vs_saved": max_diff}
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, mine)
    if rank != 0:
        return {}
    return {"model": size, "layout": layout, "world_size": world_size,
            "parallel": {k: v for k, v in LAYOUTS[layout][1].items()},
            "num_params": args.num_params[size],
            "save_s_median": round(statistics.median(save_s), 3), "save_s": [round(s, 3) for s in save_s],
            "async_blocked_s_median": round(statistics.median(blocked_s), 3),
            "async_total_s_median": round(statistics.median(total_s), 3),
            "async_blocked_fraction_of_sync_save": round(statistics.median(blocked_s) / statistics.median(save_s), 3),
            "load_s_median": round(statistics.median(load_s), 3), "load_s": [round(s, 3) for s in load_s],
            "verify_s": round(verify_s, 3), "disk": disk,
            "save_peak_memtracker_bytes_max_rank": max(r["save"]["memtracker_peak_bytes"] for r in per_rank),
            "save_peak_memtracker_over_start_bytes_max_rank": max(r["save"]["memtracker_peak_over_start_bytes"]
                                                                   for r in per_rank),
            "save_peak_rss_over_start_bytes_max_rank": max(r["save"]["rss_peak_over_start_bytes"] or 0
                                                            for r in per_rank),
            "load_peak_memtracker_bytes_max_rank": max(r["load"]["memtracker_peak_bytes"] for r in per_rank),
            "load_peak_memtracker_over_start_bytes_max_rank": max(r["load"]["memtracker_peak_over_start_bytes"]
                                                                   for r in per_rank),
            "load_peak_rss_over_start_bytes_max_rank": max(r["load"]["rss_peak_over_start_bytes"] or 0
                                                            for r in per_rank),
            "per_rank": per_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help=f"comma-separated, of {list(LAYOUTS)} (default %(default)s)")
    ap.add_argument("--large", action="store_true",
                    help="also the ~100M-parameter model (hidden 768, 12 layers, vocab 32000): opt-in, it takes "
                         "minutes on 2 cores and ~2 GB of disk per checkpoint")
    ap.add_argument("--only-large", action="store_true", help="the ~100M model alone (implies --large)")
    ap.add_argument("--repeats", type=int, default=2, help="timed saves and loads per layout (default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens of the one training step (default %(default)s)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory; "
                                                "removed after each layout)")
    args = parse_args_smoke(ap, dict(layouts="single", repeats=1, seq_len=16))
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    unknown = [s for s in layouts if s not in LAYOUTS]
    if unknown or args.repeats < 1:
        raise SystemExit(f"unknown layouts {unknown} (known: {list(LAYOUTS)}), or --repeats < 1")
    sizes = ["100m"] if args.only_large else ["smoke" if args.smoke else "tiny"] + (["100m"] if args.large else [])
    args.device = "cpu"  # what _common.run_ranks reads
    args.num_params = {s: _num_params(ModelConfig(**SIZES[s], max_seq_len=args.seq_len)) for s in sizes}
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="meshlm_ckpt_bench_"))
    results = []
    try:
        for size in sizes:
            for layout in layouts:
                root = base / f"{size}_{layout}"
                shutil.rmtree(root, ignore_errors=True)
                args.job = (size, layout, root)
                start = time.perf_counter()
                row = run_ranks(_rank, LAYOUTS[layout][0], args)
                row["wall_s"] = round(time.perf_counter() - start, 1)
                results.append(row)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"benchmark": "checkpoint", "smoke": args.smoke, "device": "cpu", "backend": "gloo",
                      "models": {s: SIZES[s] for s in sizes},
                      "large_model_included": "100m" in sizes,
                      "large_model_note": None if "100m" in sizes else
                      "the ~100M-parameter model is opt-in (--large): several minutes on 2 CPU cores",
                      "repeats": args.repeats, "notes": NOTES, "results": results}, indent=2))


if __name__ == "__main__":
    main()
