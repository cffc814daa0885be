"""meshlm expert parallelism against replicated experts: same MoE model, same batches, one run.

    python benchmarks/ep.py                                    # 4 gloo ranks on CPU: ep=4 vs ep=1
    python benchmarks/ep.py --world-sizes 2,4 --experts 16 --hidden 512 --steps 20
    python benchmarks/ep.py --device cuda --world-sizes 8 --ep 4
    python benchmarks/ep.py --smoke                            # ep=2 vs replicated on 2 ranks, one step (CI)

--smoke: world size 2 (ep=2), a 1-layer model of hidden 32 with 4 experts, one timed step, no warmup;
with --device cuda on a host without the GPUs, a JSON saying so instead.

What runs. For each world size W, ranks are spawned (one intra-op thread each); every rank builds
meshlm's reference MoE Transformer twice from the same seed (every layer MoE, `--experts` experts,
top `--top-k`, dropless unless --capacity-factor) and hands each to `parallelize`, as the trainer does:
  ep      mesh ParallelDims(dp_shard=W, ep=E), ParallelConfig(dp_shard=W, ep=E) with E = --ep (default
          W): each rank keeps num_experts / E experts of every MoE layer, tokens reach them by
          all-to-all over "ep"; the dense weights' gradients are summed over "dp", the experts' over
          "ep_dp" (size W / E: nothing to reduce when E = W);
  replicated  mesh ParallelDims(dp_shard=W), ParallelConfig(dp_shard=W): plain data parallelism, every
          rank holds every expert, all gradients summed over "dp".
Both take `build_optimizer` (torch AdamW) with TrainConfig's defaults. Each rank trains on its own
`--batch` sequences of the same global batch; the loss is sum(token losses) / global tokens plus the
model's load-balancing loss (`aux_loss()`), as `Trainer.micro_step` does. No clipping, constant lr.

What is measured, per implementation and world size:
  step time       forward + backward + optimizer step + zero_grad, median (and min) over --steps
                  steps after --warmup; each step starts from a barrier and counts the slowest rank;
                  the two implementations alternate step by step (benchmarks/_common.py). Of that,
                  optimizer_ms_median: rank 0's optimizer step + zero_grad alone.
  parameters      bytes of the parameters a rank holds (sum of numel x element size), split into
                  experts and the rest; under ep=E the experts are 1/E.
  communication   meshlm's CommStats over the timed steps, per (op, axis), divided by the steps:
                  calls, bytes and host seconds per step (all_to_all/ep: what this rank sends,
                  counts + dispatch + combine, forward and backward; all_reduce/dp: the data-
                  parallel gradient buckets). Seconds are the time inside the call (gloo is
                  synchronous), so they include waiting for the slowest rank of the group.
                  Rank 0's numbers, plus max / sum over ranks; the ranks' all-to-all bytes summed
                  are checked against the formula of meshlm.parallel.expert's docstring.
  peak memory     per rank, over one more, untimed step: torch's MemTracker (benchmarks/_common.py).
  expert load     tokens per expert (router assignments summed over all ranks) per MoE layer and
                  step: imbalance = max / mean, the mean and worst over the timed steps, and for ep
                  the same per ep rank (assignments its experts receive: the all-to-all's and the
                  local experts' bottleneck); `expert_load_stats` of the last step as reported by meshlm.
  loss            the global loss of step 1 and of the last timed step of each; they should agree.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import SMOKE_MODEL, parse_args_smoke, print_smoke_skip, smoke_cuda_missing, add_common_args, batch, device_of, measure_step, parse_world_sizes, run_ranks, time_alternating
from meshlm.comm_stats import CommStats
from meshlm.config import ModelConfig, ParallelConfig, TrainConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.models.moe import MoE
from meshlm.parallel.expert import expert_load_stats
from meshlm.parallel.parallelize import parallelize
from meshlm.train.optim import build_optimizer

REPLICATED = "replicated"


def moe_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads, intermediate_size=3 * args.hidden,
                       max_seq_len=args.seq_len, num_experts=args.experts, num_experts_per_token=args.top_k,
                       moe_intermediate_size=args.moe_intermediate or 2 * args.hidden,
                       capacity_factor=args.capacity_factor, router_aux_loss_coef=args.aux_coef)


def _param_bytes(model) -> dict:
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"param_bytes": total, "expert_param_bytes": experts, "dense_param_bytes": total - experts}


def _comm_per_step(stats: CommStats, steps: int) -> dict:
    return {f"{op}/{axis}": {"calls": s.calls / steps, "bytes": s.bytes / steps, "seconds": s.seconds / steps}
            for (op, axis), s in sorted(stats.snapshot().items())}


def _load_summary(loads: torch.Tensor, ep: int) -> dict:
    """loads [steps, moe layers, experts], summed over ranks: imbalance = max / mean per layer and step."""
    per_expert = loads.max(-1).values / loads.mean(-1)
    out = {"expert_imbalance_mean": round(per_expert.mean().item(), 4),
           "expert_imbalance_worst": round(per_expert.max().item(), 4),
           "tokens_per_expert_min": int(loads.min()), "tokens_per_expert_max": int(loads.max())}
    if ep > 1:
        per_rank = loads.view(*loads.shape[:2], ep, -1).sum(-1)  # assignments each ep rank's experts receive
        rank_imb = per_rank.max(-1).values / per_rank.mean(-1)
        out |= {"ep_rank_imbalance_mean": round(rank_imb.mean().item(), 4),
                "ep_rank_imbalance_worst": round(rank_imb.max().item(), 4)}
    return out


def _rank(rank: int, world_size: int, args) -> dict:
    device = device_of(args, rank)
    ep = args.ep or world_size
    cfg, train_cfg = moe_config(args), TrainConfig()
    global_seqs = args.batch * world_size
    global_tokens = global_seqs * args.seq_len
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    ep_name = f"ep{ep}"

    impls = {}
    for name, parallel in ((ep_name, ParallelConfig(dp_shard=world_size, ep=ep)),
                           (REPLICATED, ParallelConfig(dp_shard=world_size))):
        mesh = build_mesh(ParallelDims(dp_shard=world_size, ep=parallel.ep), device_type=device.type,
                          stats=CommStats())
        model = build_model(cfg, seed=0, device=device)
        pm = parallelize(model, mesh, parallel)
        impls[name] = dict(model=model, pm=pm, opt=build_optimizer(model, train_cfg), loads=[],
                           optimizer_seconds=[], moes=[m for m in model.modules() if isinstance(m, MoE)],
                           ep=parallel.ep)

    def make_step(impl):
        model, opt = impl["model"], impl["opt"]

        def step(i: int) -> torch.Tensor:
            inputs, targets = batch(args, i, global_seqs, device)
            logits = impl["pm"].module(inputs[mine])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[mine].flatten(),
                                   reduction="sum") / global_tokens
            aux = model.aux_loss()
            (loss + aux if torch.is_tensor(aux) else loss).backward()
            start = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            impl["optimizer_seconds"].append(time.perf_counter() - start)
            impl["loads"].append(torch.stack([m.last_tokens_per_expert for m in impl["moes"]]).to(torch.int64))
            return loss.detach()
        return step

    steps = {name: make_step(impl) for name, impl in impls.items()}
    # Warm-up here rather than in time_alternating, so CommStats can be reset between warm-up and timing.
    for i in range(args.warmup):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            steps[name](i)
    for impl in impls.values():
        impl["pm"].mesh.stats.reset()
        impl["loads"].clear()
        impl["optimizer_seconds"].clear()
    seconds, losses = time_alternating({n: (lambda i, s=s: s(i + args.warmup)) for n, s in steps.items()},
                                       warmup=0, timed=args.steps, device=device)

    rows = {}
    for name, impl in impls.items():
        pm, model = impl["pm"], impl["model"]
        comm = _comm_per_step(pm.mesh.stats, args.steps)
        a2a = comm.get("all_to_all/ep", {"bytes": 0.0, "seconds": 0.0})
        dp_ar = comm.get("all_reduce/dp", {"bytes": 0.0, "seconds": 0.0})
        ep_dp_ar = comm.get("all_reduce/ep_dp", {"bytes": 0.0, "seconds": 0.0})
        mine_numbers = [a2a["bytes"], a2a["seconds"], dp_ar["bytes"], dp_ar["seconds"], ep_dp_ar["bytes"]]
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, mine_numbers)
        # Tokens per expert summed over ranks, per timed step and MoE layer (collected locally, reduced once).
        loads = torch.stack(impl["loads"])
        dist.all_reduce(loads)
        dist.all_reduce(losses[name])  # each rank's loss is its share of the global mean
        step_ms = [s * 1e3 for s in seconds[name]]
        row = {"parallel": {"dp_shard": world_size, "ep": impl["ep"]}, **_param_bytes(model),
               "step_ms_median": round(statistics.median(step_ms), 2), "step_ms_min": round(min(step_ms), 2),
               "optimizer_ms_median": round(statistics.median(impl["optimizer_seconds"]) * 1e3, 2),
               "all_to_all_ep_bytes_per_step": a2a["bytes"],
               "all_to_all_ep_seconds_per_step": round(a2a["seconds"], 5),
               "all_to_all_ep_bytes_per_step_max_rank": max(r[0] for r in per_rank),
               "all_to_all_ep_bytes_per_step_all_ranks": sum(r[0] for r in per_rank),
               "all_to_all_ep_seconds_per_step_max_rank": round(max(r[1] for r in per_rank), 5),
               "dp_all_reduce_bytes_per_step": dp_ar["bytes"],
               "dp_all_reduce_seconds_per_step": round(dp_ar["seconds"], 5),
               "dp_all_reduce_seconds_per_step_max_rank": round(max(r[3] for r in per_rank), 5),
               "ep_dp_all_reduce_bytes_per_step": ep_dp_ar["bytes"],
               "commstats_per_step": comm,
               **_load_summary(loads.double(), impl["ep"]),
               "loss_step1": losses[name][0].item(), "loss_last_timed_step": losses[name][-1].item()}
        if impl["ep"] > 1 and not args.capacity_factor:
            # meshlm.parallel.expert: per MoE layer, forward E x 8 (counts) + S h b + R h b, backward S h b + R h b;
            # summed over the ranks, sum(R) = sum(S) = global tokens x top_k (dropless).
            b = next(model.parameters()).element_size()
            row["all_to_all_ep_bytes_all_ranks_expected"] = len(impl["moes"]) * (
                world_size * args.experts * 8 + 4 * global_tokens * args.top_k * args.hidden * b)
        rows[name] = row

    # One more, untimed step each: peak memory (MemTracker) and the collectives' bytes by op.
    for name, impl in impls.items():
        measured = measure_step(lambda: steps[name](args.warmup + args.steps), (impl["model"], impl["opt"]), device)
        rows[name] |= {k: measured[k] for k in ("peak_memory_bytes", "peak_memory_by_kind", "bytes_moved_by_op")}
        # meshlm's own summary of that step's load (collective over "dp").
        rows[name]["expert_load_stats_last_step"] = expert_load_stats(impl["model"], impl["pm"].mesh, axis="dp")

    ours, peer = rows[ep_name], rows[REPLICATED]
    ratio = lambda a, b: round(a / b, 3) if b else float("nan")  # noqa: E731
    return {"world_size": world_size, "ep": ep, "model_params": impls[REPLICATED]["model"].num_params(),
            "tokens_per_step": global_tokens, ep_name: ours, REPLICATED: peer,
            "step_time_ratio": ratio(ours["step_ms_median"], peer["step_ms_median"]),
            "param_bytes_ratio": ratio(ours["param_bytes"], peer["param_bytes"]),
            "expert_param_bytes_ratio": ratio(ours["expert_param_bytes"], peer["expert_param_bytes"]),
            "peak_memory_ratio": ratio(ours["peak_memory_bytes"], peer["peak_memory_bytes"]),
            "dp_all_reduce_bytes_ratio": ratio(ours["dp_all_reduce_bytes_per_step"],
                                               peer["dp_all_reduce_bytes_per_step"]),
            "all_to_all_share_of_step": ratio(ours["all_to_all_ep_seconds_per_step_max_rank"] * 1e3,
                                              ours["step_ms_median"]),
            "loss_max_abs_diff": max(abs(ours[k] - peer[k]) for k in ("loss_step1", "loss_last_timed_step"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, world_sizes="4")
    ap.set_defaults(hidden=256, layers=2, vocab=2048, batch=2, steps=20)
    moe = ap.add_argument_group("mixture of experts (every layer MoE)")
    moe.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default %(default)s)")
    moe.add_argument("--top-k", type=int, default=2, help="experts per token (default %(default)s)")
    moe.add_argument("--moe-intermediate", type=int, default=0,
                     help="expert MLP width; 0: 2 x hidden (default %(default)s)")
    moe.add_argument("--capacity-factor", type=float, default=0.0,
                     help="per-rank expert capacity factor; 0: dropless (default %(default)s)")
    moe.add_argument("--aux-coef", type=float, default=0.01,
                     help="load-balancing loss coefficient (default %(default)s)")
    ap.add_argument("--ep", type=int, default=0,
                    help="expert-parallel degree; 0: the world size (default %(default)s)")
    args = parse_args_smoke(ap, SMOKE_MODEL | {"experts": 4})
    if args.smoke and (why := smoke_cuda_missing(args)):
        print_smoke_skip("ep_vs_replicated_experts", {"run": why})
        return
    sizes = parse_world_sizes(args)
    for n in sizes:
        ep = args.ep or n
        if n % ep or args.experts % ep:
            raise SystemExit(f"--ep={ep} must divide the world size {n} and --experts={args.experts}")
    results = [run_ranks(_rank, n, args) for n in sizes]
    print(json.dumps({"benchmark": "ep_vs_replicated_experts", "smoke": args.smoke, "device": args.device,
                      "backend": "nccl" if args.device == "cuda" else "gloo",
                      "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                                "kv_heads": args.kv_heads, "vocab": args.vocab, "seq_len": args.seq_len,
                                "experts": args.experts, "top_k": args.top_k,
                                "moe_intermediate": args.moe_intermediate or 2 * args.hidden,
                                "capacity_factor": args.capacity_factor, "aux_coef": args.aux_coef},
                      "batch": args.batch, "warmup_steps": args.warmup, "timed_steps": args.steps,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
