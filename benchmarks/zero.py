"""meshlm ZeRO-3 against PyTorch FSDP2 (`fully_shard`): same model, same batches, one run.

    python benchmarks/zero.py                                  # world sizes 2 and 4, gloo ranks on CPU
    python benchmarks/zero.py --world-sizes 2,4,8 --device cuda --steps 20
    python benchmarks/zero.py --smoke                          # 2 ranks, hidden 32, 1 layer, one step (CI)

--smoke: the same comparison at world size 2 with a 1-layer model of hidden 32, one timed step, no warmup
(benchmarks/_common.py SMOKE_MODEL); with --device cuda on a host without the GPUs, a JSON saying so instead.

What runs. For each world size, ranks are spawned (one intra-op thread each); every rank builds
meshlm's reference Transformer twice from the same seed and shards it over all ranks:
  meshlm  `apply_zero(model, mesh, stage=3)` and the `ZeroAdamW` that
          `build_optimizer(model, train_cfg, zero=handle)` returns -- what `parallelize` and the
          trainer do for parallel.zero_stage=3;
  fsdp2   `fully_shard` on every transformer block, then on the root, with the defaults (blocks
          resharded after forward; the root's parameters -- embedding, final norm, head -- kept
          unsharded from forward to backward, where meshlm frees and gathers them again), and
          `torch.optim.AdamW` with the same hyperparameters and weight-decay groups (torch picks its
          implementation: a per-parameter loop on CPU, foreach on CUDA).
Each rank trains on its own `--batch` sequences of the global batch; the loss is
sum(token losses) / global tokens. meshlm sums gradients over ranks and FSDP2 averages them, so the
FSDP2 loss is multiplied by the world size for backward (as benchmarks/dp.py does for DDP): both
then take the same optimizer steps. No gradient clipping, constant learning rate.

What is measured, per implementation and world size:
  step time     forward + backward + optimizer step + zero_grad, median (and min) over --steps steps
                after --warmup; each step is timed from a barrier and counts the slowest rank;
                the two implementations alternate step by step.
  peak memory   per rank, over one more, untimed step: the peak sum of live tensor storages seen by
                torch's MemTracker -- parameters (full units while gathered), gradients, optimizer
                state, activations saved for backward, temporaries and communication buffers; the
                same counter for both (details in benchmarks/_common.py). Besides the model and the
                optimizer state, meshlm's long-lived flat fp32 master shard, flat gradient shard and
                the optimizer's weight-decay mask are named to the tracker (FSDP2's sharded DTensor
                parameters are its master weights; its gradients exist only from backward to zero_grad).
  bytes moved   per rank, over that step: every collective, with meshlm's CommStats convention
                (all-gather: output, reduce-scatter: input), counted by the same dispatch-mode
                counter for both; meshlm's own CommStats total is printed as a cross-check.
  loss          the global loss of step 1 and of the last timed step of each; they should agree.
Prints one JSON object: per world size a row for each implementation and the ratios ours / fsdp2
(the goal the issue states: step_time_ratio <= 1 and peak_memory_ratio <= 1).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from _common import (SMOKE_MODEL, parse_args_smoke, print_smoke_skip, smoke_cuda_missing, add_common_args, batch, compare, device_of, model_config, parse_world_sizes, print_results,
                     run_ranks)
from meshlm.comm_stats import CommStats
from meshlm.config import TrainConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.parallel.zero import apply_zero
from meshlm.train.optim import build_optimizer, param_groups

OURS, PEER = "meshlm_zero3", "fsdp2"


def _rank(rank: int, world_size: int, args) -> dict:
    device = device_of(args, rank)
    cfg, train_cfg = model_config(args), TrainConfig()
    mesh = build_mesh(ParallelDims(dp_shard=world_size), device_type=device.type, stats=CommStats())

    ours = build_model(cfg, seed=0, device=device)
    zero = apply_zero(ours, mesh, stage=3)
    ours_opt = build_optimizer(ours, train_cfg, zero=zero)

    peer = build_model(cfg, seed=0, device=device)
    shard_mesh = mesh.device_mesh["dp_shard"]
    for block in peer.layers.values():
        fully_shard(block, mesh=shard_mesh)
    fully_shard(peer, mesh=shard_mesh)
    peer_opt = torch.optim.AdamW(param_groups(peer, train_cfg.weight_decay), lr=train_cfg.lr,
                                 betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps)

    global_seqs = args.batch * world_size
    global_tokens = global_seqs * args.seq_len

    def train_step(model, opt, loss_scale: float):
        def step(i: int) -> torch.Tensor:
            inputs, targets = batch(args, i, global_seqs, device)
            mine = slice(rank * args.batch, (rank + 1) * args.batch)
            logits = model(inputs[mine])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[mine].flatten(),
                                   reduction="sum") / global_tokens
            (loss * loss_scale).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step

    steps = {OURS: train_step(ours, ours_opt, 1.0), PEER: train_step(peer, peer_opt, float(world_size))}
    externals = {OURS: (ours, ours_opt, zero.param_shard),  # the gradient shard exists only from backward to zero_grad
                 PEER: (peer, peer_opt)}
    row = compare(steps, externals, args=args, device=device, ours_stats=mesh.stats, sum_losses_over_ranks=True)
    return {"world_size": world_size, "model_params": ours.num_params(), "tokens_per_step": global_tokens, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, world_sizes="2,4")
    args = parse_args_smoke(ap, SMOKE_MODEL)
    if args.smoke and (why := smoke_cuda_missing(args)):
        print_smoke_skip("zero3_vs_fsdp2", {"run": why})
        return
    print_results("zero3_vs_fsdp2", args, [run_ranks(_rank, n, args) for n in parse_world_sizes(args)])


if __name__ == "__main__":
    main()
