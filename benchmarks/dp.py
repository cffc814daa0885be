"""meshlm data parallelism against torch's DistributedDataParallel, same model and data, one run.

    python benchmarks/dp.py                      # 2 gloo ranks on CPU, tiny model
    python benchmarks/dp.py --rounds 20 --hidden 256 --layers 4
    python benchmarks/dp.py --smoke              # 2 ranks, hidden 32, 1 layer, one step each (CI)

Spawns `--world-size` gloo ranks on this host. Each rank builds the same model twice (meshlm
`apply_data_parallel` and `torch.nn.parallel.DistributedDataParallel`, same bucket size) and times
training steps (forward, backward with the overlapped gradient all-reduce, AdamW step), alternating
between the two in rounds so that load from other processes hits both alike. Prints one JSON object:
median (and minimum) step time of each, their ratios, the bytes meshlm all-reduced per step (counted by CommStats)
next to the gradient bytes DDP reduces, and the largest weight difference between the two replicas
at the end (DDP averages gradients, so its loss is scaled by the world size to take the same steps).
--smoke: 2 ranks, a 1-layer model of hidden 32, one timed round of one step, no warmup; with --device cuda
on a host without two GPUs, a JSON saying so instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.comm_stats import CommStats
from meshlm.config import ModelConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models.transformer import build_model
from meshlm.parallel.data import apply_data_parallel

from _common import device_of, parse_args_smoke, print_smoke_skip, run_ranks, synchronize  # noqa: E402 -- benchmarks/ is on sys.path when run as a script


def _batches(args, rank: int, world_size: int, step: int, device: torch.device):
    """This rank's contiguous slice of global batch `step`."""
    g = torch.Generator().manual_seed(step)
    global_batch = args.batch * world_size
    seqs = torch.randint(0, args.vocab, (global_batch, args.seq_len + 1), generator=g)
    mine = seqs[rank * args.batch:(rank + 1) * args.batch].to(device)
    return mine[:, :-1], mine[:, 1:], global_batch * args.seq_len


def _train_step(model, opt, inputs, targets, global_tokens, scale):
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / global_tokens
    (loss * scale).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _rank(rank: int, world_size: int, args) -> dict | None:
    """One rank of the comparison (the process group is up: `_common.run_ranks`); rank 0 returns the row."""
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=4, num_kv_heads=2, intermediate_size=3 * args.hidden, max_seq_len=args.seq_len)
    device = device_of(args, rank)
    mesh = build_mesh(ParallelDims(), device_type=device.type, stats=CommStats())
    ours = build_model(cfg, seed=0, device=device)
    dp = apply_data_parallel(ours, mesh, bucket_size_mb=args.bucket_mb)
    ref = build_model(cfg, seed=0, device=device)
    ddp = torch.nn.parallel.DistributedDataParallel(ref, process_group=mesh.group("dp"),
                                                    bucket_cap_mb=args.bucket_mb)
    opts = {"meshlm": torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=False),
            "ddp": torch.optim.AdamW(ddp.parameters(), lr=1e-3, foreach=False)}
    models = {"meshlm": ours, "ddp": ddp}
    scales = {"meshlm": 1.0, "ddp": float(world_size)}  # DDP averages; meshlm sums (see parallel/data.py)
    times = {"meshlm": [], "ddp": []}
    step = 0
    for rnd in range(args.warmup + args.rounds):
        for name in ("meshlm", "ddp") if rnd % 2 == 0 else ("ddp", "meshlm"):
            dist.barrier()
            for i in range(args.steps_per_round):
                inputs, targets, tokens = _batches(args, rank, world_size, step + i, device)
                mesh.stats.reset()
                start = time.perf_counter()
                _train_step(models[name], opts[name], inputs, targets, tokens, scales[name])
                synchronize(device)  # on a GPU: its time, not the launches'
                if rnd >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                if name == "meshlm":
                    bytes_per_step = mesh.stats.total(op="all_reduce").bytes
                    calls_per_step = mesh.stats.total(op="all_reduce").calls
        step += args.steps_per_round
    max_diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    if rank == 0:
        ours_s, ddp_s = statistics.median(times["meshlm"]), statistics.median(times["ddp"])
        return {
            "benchmark": "data_parallel", "world_size": world_size,
            "backend": "nccl" if device.type == "cuda" else "gloo", "device": device.type,
            "model_params": sum(p.numel() for p in ours.parameters()),
            "tokens_per_step": args.batch * world_size * args.seq_len,
            "timed_steps_each": args.rounds * args.steps_per_round,
            "meshlm_step_ms": round(ours_s * 1e3, 2), "ddp_step_ms": round(ddp_s * 1e3, 2),
            "ratio_meshlm_over_ddp": round(ours_s / ddp_s, 3),
            "meshlm_min_step_ms": round(min(times["meshlm"]) * 1e3, 2),
            "ddp_min_step_ms": round(min(times["ddp"]) * 1e3, 2),
            "ratio_of_min": round(min(times["meshlm"]) / min(times["ddp"]), 3),
            "meshlm_bytes_all_reduced_per_step": bytes_per_step,
            "meshlm_all_reduce_calls_per_step": calls_per_step,
            "meshlm_buckets": len(dp.buckets),
            "ddp_gradient_bytes_per_step": sum(p.numel() * p.element_size() for p in ref.parameters()),
            "max_weight_diff_meshlm_vs_ddp": max_diff,
        }
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds, alternating which goes first")
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: gloo ranks with one thread each; cuda: one GPU per rank, NCCL")
    args = parse_args_smoke(ap, dict(world_size=2, hidden=32, layers=1, vocab=64, seq_len=16, batch=2, warmup=0,
                                     rounds=1, steps_per_round=1))
    if args.smoke and args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        print_smoke_skip("data_parallel", {"run": f"--device cuda needs one GPU per rank; this machine has "
                                                  f"{torch.cuda.device_count()}"})
        return
    result = run_ranks(_rank, args.world_size, args)
    print(json.dumps({**result, "smoke": args.smoke}, indent=2))


if __name__ == "__main__":
    main()
