"""Mixture-of-Experts feed-forward layer: router, routed experts, optional shared experts.

Responsible for: softmax top-k routing (optionally renormalised), the experts' SwiGLU weights stored
stacked as `[num_experts, ...]` tensors (so expert parallelism shards dim 0), a dropless reference
computation (every routed token is processed), optional shared experts with an optional sigmoid gate,
and the auxiliary load-balancing loss of the last forward.
Not responsible for: dispatching tokens across ranks (`meshlm.parallel.expert` replaces `experts_forward`).
"""

from __future__ import annotations

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
        """Dropless: for each expert, gather its tokens, run it, scatter-add the weighted result."""
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

    def route(self, x_td: torch.Tensor):
        """Top-k experts and their weights per token, plus the load-balancing loss."""
        probs_te = F.softmax(self.router(x_td), dim=-1, dtype=torch.promote_types(x_td.dtype, torch.float32))
        weight_tk, expert_idx_tk = torch.topk(probs_te, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight_tk = weight_tk / weight_tk.sum(dim=-1, keepdim=True)
        # Switch-Transformer balance loss: E * sum_e (fraction of assignments to e) * (mean prob of e).
        counts_e = torch.zeros(self.num_experts, device=x_td.device, dtype=torch.float32)
        counts_e.scatter_add_(0, expert_idx_tk.reshape(-1), torch.ones_like(expert_idx_tk.reshape(-1), dtype=torch.float32))
        fraction_e = counts_e / expert_idx_tk.numel()
        aux = self.num_experts * (fraction_e * probs_te.mean(dim=0)).sum()
        return expert_idx_tk, weight_tk, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_td = x.reshape(-1, shape[-1])
        expert_idx_tk, weight_tk, aux = self.route(x_td)
        self.last_aux_loss = aux
        out = self.experts(x_td, expert_idx_tk, weight_tk)
        if self.shared is not None:
            shared = self.shared(x_td)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_td)) * shared
            out = out + shared
        return out.reshape(shape)
