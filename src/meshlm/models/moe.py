"""Mixture-of-Experts feed-forward layer: router, routed experts, optional shared experts.

Responsible for: softmax top-k routing (optionally renormalised), the experts' SwiGLU weights stored
stacked as `[num_experts, ...]` tensors (so expert parallelism shards dim 0), the reference
computation (dropless by default; with `model.capacity_factor > 0` the capacity rule of
`drop_over_capacity`), optional shared experts with an optional sigmoid gate, the auxiliary
load-balancing loss of the last forward (over a micro-batch's tokens, also where ranks split them:
`token_shards`), the per-expert selection bias of aux-loss-free balancing
(`router_bias`, used for top-k selection only) and the per-expert load that updates it
(`last_tokens_per_expert`, `load_since_update`, `last_dropped`).
Not responsible for: dispatching tokens across ranks (`meshlm.parallel.expert` replaces the forward
of `Experts`), or updating `router_bias` (`meshlm.parallel.expert.update_router_biases`, which can
sum the load over data-parallel ranks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.config import ModelConfig


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: w_gate/w_up [E, inter, hidden], w_down [E, hidden, inter]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act(F.linear(x, self.w_gate[e]), F.linear(x, self.w_up[e])), self.w_down[e])

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, replaceable by a transform (selective recomputation, `meshlm.parallel.recompute`)."""
        return F.silu(gate) * up

    def forward(self, x_td: torch.Tensor, expert_idx_tk: torch.Tensor, weight_tk: torch.Tensor) -> torch.Tensor:
        """For each expert, gather its tokens, run it, scatter-add the weighted result.

        An expert index of -1 (an assignment dropped over capacity) matches no expert: it adds nothing."""
        out = torch.zeros_like(x_td)
        flat_expert = expert_idx_tk.reshape(-1)
        flat_token = torch.arange(x_td.shape[0], device=x_td.device).repeat_interleave(expert_idx_tk.shape[1])
        flat_weight = weight_tk.reshape(-1)
        for e in range(self.w_gate.shape[0]):
            sel = (flat_expert == e).nonzero(as_tuple=True)[0]
            if sel.numel() == 0:
                continue
            tokens = flat_token[sel]
            y = self.expert(e, x_td[tokens]) * flat_weight[sel, None].to(x_td.dtype)
            out.index_add_(0, tokens, y)
        return out


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.norm_topk_prob = config.norm_topk_prob
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.expert_intermediate_size)
        self.shared = None
        self.shared_gate = None
        if config.shared_intermediate_size > 0:
            from meshlm.models.transformer import MLP  # local import: transformer imports this module

            self.shared = MLP(config.hidden_size, config.shared_intermediate_size)
            if config.shared_expert_gate:
                self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.last_aux_loss: torch.Tensor | None = None
        self.capacity_factor = config.capacity_factor
        self.router_bias_update_rate = config.router_bias_update_rate
        # A plain float32 tensor, not a registered buffer (like the Transformer's inv_freq): build_model
        # creates modules on the meta device and `to_empty` would leave a buffer uninitialised, and
        # `.to(bfloat16)` would round away updates of 1e-3. Moved to the input's device on first use.
        self.router_bias: torch.Tensor | None = None
        if config.router_bias_update_rate > 0:
            with torch.device("cpu"):
                self.router_bias = torch.zeros(config.num_experts, dtype=torch.float32)
        self.last_tokens_per_expert: torch.Tensor | None = None  # router assignments per expert, last forward
        self.load_since_update: torch.Tensor | None = None  # the same, summed over training forwards
        self.last_dropped: torch.Tensor | None = None  # assignments dropped over capacity, last forward
        # None here: this layer sees all of a micro-batch's tokens. Where ranks split them (context
        # parallelism; tensor parallelism's sequence parallelism) `meshlm.parallel.expert.balance_over`
        # sets a function that sums a tensor over those ranks (counts, no gradient).
        self.token_shards = None

    def route(self, x_td: torch.Tensor):
        """Top-k experts and their weights per token, plus the load-balancing loss."""
        probs_te = F.softmax(self.router(x_td), dim=-1, dtype=torch.promote_types(x_td.dtype, torch.float32))
        if self.router_bias is None:
            weight_tk, expert_idx_tk = torch.topk(probs_te, self.top_k, dim=-1)
        else:
            # DeepSeek-V3: the bias steers which experts are chosen; the weights stay the router's own.
            if self.router_bias.device != probs_te.device:
                self.router_bias = self.router_bias.to(probs_te.device)
            expert_idx_tk = torch.topk(probs_te.detach() + self.router_bias.to(probs_te.dtype), self.top_k,
                                       dim=-1).indices
            weight_tk = probs_te.gather(-1, expert_idx_tk)
        if self.norm_topk_prob:
            weight_tk = weight_tk / weight_tk.sum(dim=-1, keepdim=True)
        # Switch-Transformer balance loss: E * sum_e (fraction of assignments to e) * (mean prob of e),
        # both over the micro-batch's tokens. Where ranks split those tokens (`token_shards`), the counts
        # are summed over them and each rank's loss is its own tokens' share of the mean probability:
        # the shares add up to the whole loss, and so do the gradients the ranks sum.
        counts_e = torch.zeros(self.num_experts + 1, device=x_td.device, dtype=torch.float32)
        counts_e.scatter_add_(0, expert_idx_tk.reshape(-1), torch.ones_like(expert_idx_tk.reshape(-1), dtype=torch.float32))
        counts_e[-1] = x_td.shape[0]  # the tokens, summed with the counts
        if self.token_shards is not None:
            counts_e = self.token_shards(counts_e)
        num_tokens = counts_e[-1]
        fraction_e = counts_e[:-1] / (num_tokens * self.top_k)
        aux = self.num_experts * (fraction_e * (probs_te.sum(dim=0) / num_tokens)).sum()
        return expert_idx_tk, weight_tk, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_td = x.reshape(-1, shape[-1])
        expert_idx_tk, weight_tk, aux = self.route(x_td)
        self.last_aux_loss = aux
        self._record_load(expert_idx_tk, training=self.training and torch.is_grad_enabled())
        if self.capacity_factor > 0:
            expert_idx_tk, self.last_dropped = drop_over_capacity(
                expert_idx_tk, weight_tk, num_experts=self.num_experts, capacity_factor=self.capacity_factor)
        else:
            self.last_dropped = torch.zeros((), dtype=torch.int64, device=x_td.device)
        out = self.experts(x_td, expert_idx_tk, weight_tk)
        if self.shared is not None:
            shared = self.shared(x_td)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_td)) * shared
            out = out + shared
        return out.reshape(shape)

    @torch.no_grad()
    def _record_load(self, expert_idx_tk: torch.Tensor, *, training: bool) -> None:
        # The load is what the router chose, before capacity drops: that is what the bias must balance.
        load_e = torch.bincount(expert_idx_tk.reshape(-1), minlength=self.num_experts)
        self.last_tokens_per_expert = load_e
        # Only training forwards steer the bias (not evaluation under no_grad). A recomputed forward
        # (activation checkpointing) counts twice, which scales every expert alike: the update reads
        # only the sign of (mean - load), so it is unchanged.
        if training:
            self.load_since_update = load_e if self.load_since_update is None else self.load_since_update + load_e


@torch.no_grad()
def drop_over_capacity(expert_idx_tk: torch.Tensor, weight_tk: torch.Tensor, *, num_experts: int,
                       capacity_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cap each expert at ceil(capacity_factor * tokens * top_k / num_experts) assignments of these tokens.

    Among an expert's assignments the lowest router weights are dropped first (ties: later tokens
    first). Returns the expert indices with dropped assignments set to -1, and how many were dropped
    (a 0-d int64 tensor). The same rule runs in the reference and, per rank on the rank's own tokens,
    under expert parallelism, so both compute the same thing.
    """
    num_tokens, top_k = expert_idx_tk.shape
    capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    flat_e = expert_idx_tk.reshape(-1)
    # Heaviest first, then grouped by expert (both sorts stable): each expert's assignments in priority order.
    by_weight = torch.argsort(weight_tk.reshape(-1), descending=True, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]
    counts_e = torch.bincount(flat_e, minlength=num_experts)
    starts_e = torch.cumsum(counts_e, 0) - counts_e
    position = torch.arange(flat_e.numel(), device=flat_e.device) - starts_e[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = position < capacity
    return torch.where(keep, flat_e, -1).reshape(expert_idx_tk.shape), (~keep).sum()
