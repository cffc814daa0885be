"""meshlm tensor parallelism against DTensor's `parallelize_module`: same model, same batches, one run.

    python benchmarks/tp.py                                    # tp=2, gloo ranks on CPU
    python benchmarks/tp.py --world-sizes 2,4 --kv-heads 4 --device cuda --steps 20
    python benchmarks/tp.py --smoke                            # tp=2, hidden 32, 1 layer, one step (CI)

What runs. For each world size (= the tp degree; no data parallelism), ranks are spawned (one
intra-op thread each); every rank builds meshlm's reference Transformer twice from the same seed:
  meshlm  `apply_tensor_parallel(model, mesh, sequence_parallel=True)`; the model returns this
          rank's vocab slice of the logits and the loss is `vocab_parallel_cross_entropy`;
          `build_optimizer` (torch AdamW, per-parameter loop) -- what `parallelize` and the trainer do;
  dtensor `parallelize_module` with the torchtitan plan for a Llama block: wq/wk/wv/w_gate/w_up
          ColwiseParallel, wo/w_down RowwiseParallel(output_layouts=Shard(1)), the RMSNorms
          SequenceParallel, attention and MLP inputs all-gathered by PrepareModuleInput
          (Shard(1) -> Replicate), the embedding RowwiseParallel(input_layouts=Replicate(),
          output_layouts=Shard(1)), lm_head ColwiseParallel(input_layouts=Shard(1),
          output_layouts=Shard(-1), use_local_output=False) with the loss under `loss_parallel()`
          (vocab-parallel cross entropy, like meshlm's; it works on gloo); `torch.optim.AdamW` with
          the same hyperparameters and weight-decay groups (torch picks its implementation).
          The residual stream between blocks is a plain local tensor holding this rank's sequence
          chunk, so the reference model's `Transformer.forward` derives the RoPE positions from the
          chunk length; the benchmark passes `positions=arange(seq_len)` (meshlm's transform adds
          the same argument with a forward pre-hook). Attention reads its head counts from the
          projection widths (`out_features`), which `parallelize_module` leaves at the full model's
          while each rank's weights hold 1/tp of the heads: the peer sets each rank's head counts on
          the attention modules, as meshlm's `apply_tensor_parallel` does.
Both see the whole global batch (`--batch` sequences) on every rank; the loss is
sum(token losses) / tokens. No gradient clipping, constant learning rate.

What is measured, per implementation:
  step time     forward + backward + optimizer step + zero_grad, median (and min) over --steps steps
                after --warmup; each step is timed from a barrier and counts the slowest rank;
                the two implementations alternate step by step.
  bytes moved   per rank, over one more, untimed step: every collective (c10d and the functional
                collectives DTensor issues) with meshlm's CommStats convention, counted by the same
                dispatch-mode counter for both (benchmarks/_common.py); meshlm's own CommStats total
                is printed as a cross-check.
  peak memory   per rank, over that step, with torch's MemTracker (see benchmarks/_common.py).
  loss          the loss of step 1 and of the last timed step of each; they should agree.
Prints one JSON object with step_time_ratio = meshlm / dtensor (the goal the issue states: <= 0.9).
--smoke: the same run at tp=2 with a 1-layer model of hidden 32, one timed step, no warmup (benchmarks/
_common.py SMOKE_MODEL); with --device cuda on a host without the GPUs, a JSON saying so instead.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from _common import (SMOKE_MODEL, add_common_args, batch, compare, device_of, model_config, parse_args_smoke,
                     parse_world_sizes, print_results, print_smoke_skip, run_ranks, smoke_cuda_missing)
from meshlm.comm_stats import CommStats
from meshlm.config import TrainConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from meshlm.train.optim import build_optimizer, param_groups

OURS, PEER = "meshlm_tp", "dtensor_tp"


def dtensor_parallelize(model, tp_mesh) -> None:
    """The torchtitan-style tensor + sequence parallel plan, applied in place."""
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            # Attention.forward(x, cos, sin, cache, layer): only x is sharded (over the sequence)
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None, None)),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": ColwiseParallel(),
            "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=Shard(1)),
        })
        # Attention counts its heads from wq/wk/wv's out_features, which parallelize_module leaves at the
        # full width; the local outputs hold this rank's heads only (as meshlm's own transform records).
        tp = tp_mesh.size()
        attn = block.attn
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
        for linear in (attn.wq, attn.wk, attn.wv):
            linear.out_features //= tp


def _rank(rank: int, world_size: int, args) -> dict:
    device = device_of(args, rank)
    cfg, train_cfg = model_config(args), TrainConfig()
    mesh = build_mesh(ParallelDims(tp=world_size), device_type=device.type, stats=CommStats())
    tokens = args.batch * args.seq_len
    positions = torch.arange(args.seq_len, device=device)

    ours = apply_tensor_parallel(build_model(cfg, seed=0, device=device), mesh, sequence_parallel=True)
    ours_opt = build_optimizer(ours, train_cfg)

    peer = build_model(cfg, seed=0, device=device)
    model_params = peer.num_params()
    dtensor_parallelize(peer, mesh.device_mesh["tp"])
    peer_opt = torch.optim.AdamW(param_groups(peer, train_cfg.weight_decay), lr=train_cfg.lr,
                                 betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps)

    def ours_step(i: int) -> torch.Tensor:
        inputs, targets = batch(args, i, args.batch, device)
        logits_local = ours(inputs)  # [batch, seq, vocab / tp]
        loss = vocab_parallel_cross_entropy(logits_local, targets, mesh, reduction="sum") / tokens
        loss.backward()
        ours_opt.step()
        ours_opt.zero_grad(set_to_none=True)
        return loss.detach()

    def peer_step(i: int) -> torch.Tensor:
        inputs, targets = batch(args, i, args.batch, device)
        logits = peer(inputs, positions=positions)  # a DTensor sharded over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens
            loss.backward()
        peer_opt.step()
        peer_opt.zero_grad(set_to_none=True)
        return loss.detach().to_local()

    steps = {OURS: ours_step, PEER: peer_step}
    externals = {OURS: (ours, ours_opt), PEER: (peer, peer_opt)}
    row = compare(steps, externals, args=args, device=device, ours_stats=mesh.stats, sum_losses_over_ranks=False)
    return {"tp": world_size, "model_params": model_params, "tokens_per_step": tokens, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, world_sizes="2")
    ap.set_defaults(batch=4)
    args = parse_args_smoke(ap, SMOKE_MODEL)
    if args.smoke and (why := smoke_cuda_missing(args)):
        print_smoke_skip("tp_vs_dtensor", {"run": why})
        return
    print_results("tp_vs_dtensor", args, [run_ranks(_rank, n, args) for n in parse_world_sizes(args)])


if __name__ == "__main__":
    main()
