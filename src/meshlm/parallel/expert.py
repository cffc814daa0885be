"""Expert parallelism: expert placement, the "ep"/"ep_dp" groups, all-to-all dispatch and combine.

Responsible for:
  placement   `expert_mesh(mesh, ep)` attaches two axes to a Mesh. "ep": `ep` consecutive coordinates
              of the rank's dp_shard x cp group (coords [g*ep, (g+1)*ep)); ep rank j holds experts
              [j*E/ep, (j+1)*E/ep). "ep_dp": the ranks holding the same experts (same position j in
              their ep group, over every ep group of the dp_shard x cp group and every dp_replicate
              replica) -- what expert gradients are summed over, as "dp_cp" is for the other weights.
  transform   `apply_expert_parallel(model, mesh)` slices every MoE's stacked expert weights to the
              local experts in place (tagged `_meshlm_shard = ("ep", 0)`) and replaces the forward of
              its `Experts` with the dispatch below. Router, shared expert and capacity rule stay the
              reference's (`meshlm.models.moe`), run on every rank on its own tokens.
  dispatch    per-expert counts exchanged by one all_to_all; the rank's (kept) assignments, sorted by
              expert, sent by the autograd-aware uneven all_to_all; the local experts run as one
              grouped matmul where torch has one for the dtype and device, else a loop; the results
              go back by the inverse all_to_all and are summed into token order with the router
              weights (the same order of additions as the reference).
  balancing   `balance_over` (the load-balancing loss of a micro-batch whose tokens ranks split: cp, SP),
              `update_router_biases` (aux-loss-free, DeepSeek-V3) and `expert_load_stats` (logging).
Not responsible for: reducing expert gradients over "ep_dp" or the others over "dp_cp" (the data-
parallel transforms, wired by `parallelize.py`), checkpointing the expert shards (`checkpoint/shards.py`), or the
capacity rule itself (`meshlm.models.moe.drop_over_capacity`; it runs per rank on the rank's tokens).

Bytes per MoE layer and rank (CommStats counts what a rank sends in an all_to_all), with S = this
rank's kept assignments (tokens x top_k when dropless), R = the assignments its experts received
(summed over the ep group, R and S have the same total), h = hidden size, b = element size:
  forward    all_to_all of num_experts x 8 bytes (int64 counts), then S*h*b (dispatch), R*h*b (combine)
  backward   S*h*b (combine's inverse), then R*h*b (dispatch's inverse); no counts (splits are kept)
all under op "all_to_all", axis "ep". Reading the counts back costs one host sync per layer.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh, ParallelDims, create_groups, every_group, group_ranks, rank_coords
from meshlm.models.moe import Experts, MoE
from meshlm.rules import check_ep_groups

AXIS = "ep"
DATA_AXIS = "ep_dp"
_MARK = "_meshlm_expert_parallel"


# --------------------------------------------------------------------------------------------
# Placement: the ep and expert-data-parallel groups
# --------------------------------------------------------------------------------------------


def _check_ep(dims: ParallelDims, ep: int) -> None:
    check_ep_groups(ep, dp_shard=dims.dp_shard, cp=dims.cp)


def ep_group_ranks(dims: ParallelDims, rank: int, ep: int) -> list[int]:
    """Global ranks of `rank`'s ep group, by ep coordinate: a run of `ep` dp_shard x cp coordinates."""
    _check_ep(dims, ep)
    members = group_ranks(dims, rank, "dp_shard_cp")
    first = rank_coords(dims, rank)["dp_shard_cp"] // ep * ep
    return members[first:first + ep]


def ep_dp_group_ranks(dims: ParallelDims, rank: int, ep: int) -> list[int]:
    """Global ranks holding the same experts as `rank`, ordered by (dp_replicate, dp_shard x cp)."""
    _check_ep(dims, ep)
    position = rank_coords(dims, rank)["dp_shard_cp"] % ep
    return [r for replica in group_ranks(dims, rank, "dp_replicate")
            for r in group_ranks(dims, replica, "dp_shard_cp")[position::ep]]


def expert_mesh(mesh: Mesh, ep: int | None = None) -> Mesh:
    """`mesh` plus the axes "ep" and "ep_dp" (same CommStats); collective over the world.

    `ep` defaults to `mesh.dims.ep`. Every rank creates every group, in the same order; a group of
    one rank (and every group of a one-process world) is None, which `meshlm.comm` never touches.
    The ranks of every group go with the axes, so `Mesh.duplicate` can create them again (ZeRO-3's
    parameter gathers over "ep_dp").
    """
    ep = mesh.dims.ep if ep is None else ep
    _check_ep(mesh.dims, ep)
    axes, every = {}, {}
    for axis, members_of in ((AXIS, ep_group_ranks), (DATA_AXIS, ep_dp_group_ranks)):
        mine, group = members_of(mesh.dims, mesh.rank, ep), None
        every[axis] = every_group(mesh.world_size, lambda r: members_of(mesh.dims, r, ep))  # noqa: B023
        if len(mine) > 1 and mesh.device_mesh is not None:  # the same size on every rank: all agree
            group = create_groups(every[axis], mesh.rank)
        axes[axis] = (mine, group)
    return mesh.with_axes(axes, every=every)


# --------------------------------------------------------------------------------------------
# The transform
# --------------------------------------------------------------------------------------------


def apply_expert_parallel(model: nn.Module, mesh: Mesh, *, grouped_mm: bool | None = None) -> nn.Module:
    """Keep only this rank's experts in every MoE of `model` and dispatch tokens to them; in place.

    `mesh` must come from `expert_mesh`. `grouped_mm`: None uses torch's grouped matmul where it
    runs for the experts' dtype and device (probed once here), True insists, False loops over experts.
    A model (or pipeline stage) without MoE layers is left as it is.
    """
    try:
        ep = mesh.size(AXIS)
    except ValueError:
        raise ValueError("apply_expert_parallel needs a mesh with an 'ep' axis; pass "
                         "meshlm.parallel.expert.expert_mesh(mesh, ep)") from None
    if getattr(model, _MARK, None) is not None:
        raise ValueError(f"expert parallelism (ep={getattr(model, _MARK)}) was applied to this model already; "
                         "build a fresh model to change it (a second pass would slice the local experts again)")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        if moe.num_experts % ep != 0:
            raise ValueError(f"model.num_experts={moe.num_experts} is not divisible by parallel.ep={ep}; "
                             f"choose ep dividing {moe.num_experts}")
    runs = bool(moes) and _grouped_mm_runs(moes[0].experts)  # the MoEs of one model share dtype and device
    if grouped_mm and moes and not runs:
        w = moes[0].experts.w_gate
        raise ValueError(f"grouped_mm=True, but torch's grouped matmul does not run for {w.dtype} on "
                         f"{w.device.type}; pass grouped_mm=None (use it where it runs) or False")
    use_grouped = runs if grouped_mm is None else grouped_mm
    setattr(model, _MARK, ep)
    j = mesh.local_rank(AXIS)
    for moe in moes:
        experts, num_local = moe.experts, moe.num_experts // ep
        for name in ("w_gate", "w_up", "w_down"):
            full = getattr(experts, name)
            local = nn.Parameter(full.detach()[j * num_local:(j + 1) * num_local].clone(),
                                 requires_grad=full.requires_grad)
            local._meshlm_shard = (AXIS, 0)
            setattr(experts, name, local)
        experts.expert_range = (j * num_local, (j + 1) * num_local)  # global ids of the local experts
        # An instance attribute shadows Experts.forward; nn.Module.__call__ (and its hooks) still run.
        experts.forward = functools.partial(_dispatch_combine, experts, mesh=mesh, num_experts=moe.num_experts,
                                            grouped_mm=use_grouped)
    return model


# --------------------------------------------------------------------------------------------
# Dispatch, local experts, combine
# --------------------------------------------------------------------------------------------


def _dispatch_combine(experts: Experts, x_td: torch.Tensor, expert_idx_tk: torch.Tensor, weight_tk: torch.Tensor,
                      *, mesh: Mesh, num_experts: int, grouped_mm: bool) -> torch.Tensor:
    """What `Experts.forward` computes, with the experts spread over the ep group (index -1: dropped)."""
    ep = mesh.size(AXIS)
    num_local = num_experts // ep
    flat_e = expert_idx_tk.reshape(-1)
    # Dropped assignments (-1) count as a virtual expert past the last one, and are cut below.
    valid_e = torch.where(flat_e < 0, num_experts, flat_e)
    send_e = torch.bincount(valid_e, minlength=num_experts + 1)[:num_experts]
    # Grouped by expert -- and so by destination rank, each holding a contiguous block -- in token order.
    order = torch.argsort(valid_e, stable=True)
    recv_je = comm.all_to_all_single(send_e, mesh, AXIS).view(ep, num_local)  # [source rank, local expert]
    counts = torch.cat([send_e.view(ep, num_local).sum(1), recv_je.sum(1), recv_je.sum(0)]).tolist()
    send_splits, recv_splits, per_local = counts[:ep], counts[ep:2 * ep], counts[2 * ep:]
    order = order[:sum(send_splits)]
    token = order // expert_idx_tk.shape[1]
    x_recv = comm.all_to_all(x_td[token], mesh, AXIS, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    # Rows arrive by source rank, then local expert; the experts want them by local expert.
    local_of_row = torch.repeat_interleave(torch.arange(ep * num_local, device=x_td.device) % num_local,
                                           recv_je.reshape(-1))
    by_expert = torch.argsort(local_of_row, stable=True)
    y_sorted = _local_experts(experts, x_recv[by_expert], per_local, grouped_mm=grouped_mm)
    y_recv = y_sorted[torch.argsort(by_expert)]
    y_back = comm.all_to_all(y_recv, mesh, AXIS, output_split_sizes=send_splits, input_split_sizes=recv_splits)
    weight = weight_tk.reshape(-1)[order].to(x_td.dtype)
    return torch.zeros_like(x_td).index_add(0, token, y_back * weight[:, None])


def _local_experts(experts: Experts, x: torch.Tensor, per_local: list[int], *, grouped_mm: bool) -> torch.Tensor:
    """Rows grouped by local expert (`per_local` rows each) through their experts."""
    if grouped_mm:
        # torch 2.13's CPU grouped_mm backward rejects an expanded (stride-0) output gradient, e.g. of
        # `.sum()`; here the gradient arrives through the un-permuting index, which makes it dense.
        offs = torch.tensor(list(itertools.accumulate(per_local)), dtype=torch.int32, device=x.device)
        gate = F.grouped_mm(x, experts.w_gate.transpose(-2, -1), offs=offs)
        up = F.grouped_mm(x, experts.w_up.transpose(-2, -1), offs=offs)
        return F.grouped_mm(experts.act(gate, up), experts.w_down.transpose(-2, -1), offs=offs)
    # Empty experts run too (on zero rows): their weights then get a zero gradient rather than None,
    # which data-parallel gradient hooks expect of every parameter.
    return torch.cat([experts.expert(e, chunk) for e, chunk in enumerate(x.split(per_local))])


def _grouped_mm_runs(experts: Experts) -> bool:
    """Whether torch's grouped matmul runs forward for these weights (dtype, device, shapes)."""
    if not hasattr(F, "grouped_mm"):
        return False
    w = experts.w_gate.detach()
    x = torch.zeros(w.shape[0], w.shape[2], dtype=w.dtype, device=w.device)
    try:
        F.grouped_mm(x, w.transpose(-2, -1), offs=torch.arange(1, w.shape[0] + 1, dtype=torch.int32,
                                                                device=w.device))
    except (RuntimeError, NotImplementedError):  # e.g. float64, or a GPU older than the kernel needs
        return False
    return True


# --------------------------------------------------------------------------------------------
# Load: aux-loss-free balancing and logging
# --------------------------------------------------------------------------------------------


def _summed(tensors: list[torch.Tensor], mesh: Mesh | None, axes: tuple[str, ...]) -> torch.Tensor:
    """The tensors stacked and summed over each of `axes`, one all_reduce each (no-op without a mesh)."""
    stacked = torch.stack(tensors).to(torch.int64).contiguous()
    for axis in axes if mesh is not None else ():
        stacked = comm.all_reduce(stacked, mesh, axis)
    return stacked


def _axes(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def balance_over(model: nn.Module, mesh: Mesh, axes: tuple[str, ...]) -> None:
    """Make every MoE's load-balancing loss that of the whole micro-batch when the ranks of `axes` split
    its tokens (context parallelism "cp", sequence parallelism "tp"): the per-expert counts and the token
    count are summed over them (one all_reduce of num_experts + 1 floats per axis, per MoE forward)."""
    axes = tuple(a for a in axes if mesh.size(a) > 1)
    if not axes:
        return

    def summed(counts: torch.Tensor) -> torch.Tensor:
        for axis in axes:
            counts = comm.all_reduce(counts.contiguous(), mesh, axis)
        return counts

    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.token_shards = summed


@torch.no_grad()
def update_router_biases(model: nn.Module, mesh: Mesh | None = None, *,
                         axis: str | tuple[str, ...] = "dp_cp") -> None:
    """After an optimizer step: bias_e += rate * sign(mean load - load_e) in every MoE with a bias.

    The load is each expert's router assignments over the training forwards since the last update,
    summed over `axis` (the ranks that see different tokens, one axis or several: under sequence
    parallelism also "tp"; collective there) when `mesh` is given, so every rank applies the same update.
    MoEs without `model.router_bias_update_rate` are skipped.
    """
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.router_bias is not None]
    if not moes:
        return
    loads = _summed([m.load_since_update if m.load_since_update is not None
                     else torch.zeros(m.num_experts, dtype=torch.int64, device=m.router_bias.device)
                     for m in moes], mesh, _axes(axis))
    for moe, load_e in zip(moes, loads):
        load_e = load_e.to(moe.router_bias.device, torch.float32)
        moe.router_bias += moe.router_bias_update_rate * torch.sign(load_e.mean() - load_e)
        moe.load_since_update = None


@torch.no_grad()
def expert_load_stats(model: nn.Module, mesh: Mesh | None = None, *,
                      axis: str | tuple[str, ...] = "dp_cp") -> dict[str, dict]:
    """Per MoE of the last forward: tokens per expert min / max, imbalance (= max / mean) and the
    assignments dropped over capacity, summed over `axis` (collective there) when `mesh` is given."""
    named = [(name, m) for name, m in model.named_modules()
             if isinstance(m, MoE) and m.last_tokens_per_expert is not None]
    if not named:
        return {}
    rows = [torch.cat([m.last_tokens_per_expert, m.last_dropped.reshape(1)]) for _, m in named]
    stats = {}
    for (name, _), row in zip(named, _summed(rows, mesh, _axes(axis)).tolist()):
        load, dropped = row[:-1], row[-1]
        mean = sum(load) / len(load)
        stats[name] = {"min": min(load), "max": max(load), "imbalance": max(load) / mean if mean else math.nan,
                       "dropped": dropped}
    return stats


def router_biases(model: nn.Module) -> dict[str, list[float]]:
    """The aux-loss-free selection bias of every MoE that has one, as plain data (checkpoint extras)."""
    return {name: m.router_bias.tolist() for name, m in model.named_modules()
            if isinstance(m, MoE) and m.router_bias is not None}


@torch.no_grad()
def set_router_biases(model: nn.Module, biases: dict[str, list[float]]) -> None:
    """Restore what `router_biases` returned (a checkpoint without them leaves the biases as they are)."""
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m.router_bias is not None and name in biases:
            m.router_bias.copy_(torch.tensor(biases[name], dtype=m.router_bias.dtype))
