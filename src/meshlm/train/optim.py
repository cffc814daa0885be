"""Optimizer, learning-rate schedule and gradient clipping for training.

Responsible for: AdamW over fp32 parameters (its state is therefore fp32 too: with bf16 autocast only
the compute is bf16, the master weights and moments stay fp32), weight decay on >= 2-D weights only
(norm scales and biases are not decayed), the schedule (linear warmup, then cosine or linear decay
to `min_lr_ratio * lr`, or constant), and global-norm gradient clipping with a hook through which a
distributed strategy supplies the norm over all shards.
Not responsible for: sharding optimizer state (`meshlm.parallel.zero_adamw.ZeroAdamW`, which `build_optimizer`
returns when given a ZeRO handle).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from meshlm.config import TrainConfig
from meshlm.parallel.zero_adamw import ZeroAdamW


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: >= 2-D weights (matrices, embeddings, stacked experts) decayed; 1-D tensors not."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, *, zero=None) -> torch.optim.Optimizer:
    """AdamW over `model`; with a `meshlm.parallel.zero.ZeroSharding` handle, the ZeRO AdamW over this
    rank's flat shard (same hyperparameters, same decay rule, same `param_groups[...]["lr"]` interface)."""
    for name, p in model.named_parameters():
        if p.dtype not in (torch.float32, torch.float64):  # fp64: train.precision=fp64, for parity proofs
            raise ValueError(f"parameter {name} is {p.dtype}; the optimizer keeps fp32 master weights, so build "
                             "the model in fp32 and use train.precision=bf16 for bf16 compute (autocast)")
    if zero is not None:
        return ZeroAdamW(zero, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    # On CPU foreach=False keeps the update a plain per-parameter loop: identical numerics whatever the grouping
    # (the parity proofs). On CUDA the fused kernel: one launch for all parameters instead of ~10 per parameter.
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    kind = {"fused": True} if on_cuda else {"foreach": False}
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, **kind)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `cfg.steps`."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        factor = 1.0 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * factor)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    # The schedule is a pure function of the step, so nothing about it needs checkpointing.
    for group in optimizer.param_groups:
        group["lr"] = lr


# A strategy's global gradient norm from this process's gradients (see `ParallelModel.grad_norm_fn`).
NormFn = Callable[[list[torch.Tensor]], torch.Tensor]


def local_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over the given gradients, in fp32."""
    if not grads:
        return torch.zeros(())
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.promote_types(g.dtype, torch.float32))
                         for g in grads])
    return torch.linalg.vector_norm(norms)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, *, norm_fn: NormFn | None = None) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most `max_norm`; return the norm before clipping.

    `norm_fn(grads) -> scalar tensor` computes the global norm from this process's gradients. The
    default is the plain local norm, right for one process and for replicated (DDP) gradients after
    their all-reduce. A strategy whose gradients are sharded (ZeRO-2/3, tensor or pipeline parallel)
    passes a function that sums the squared norms of the shards over its mesh axes -- counting
    replicated tensors once -- and takes the square root, so every rank clips by the same factor.
    `max_norm <= 0` only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = (norm_fn or local_grad_norm)(grads)
    if max_norm > 0 and grads:
        # Multiplying by a clamped factor (instead of branching on the norm) needs no host sync.
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor.to(g.device, g.dtype))
    return total
