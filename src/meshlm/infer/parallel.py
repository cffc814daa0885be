"""Serving on several ranks: one engine on rank 0; the model split over "tp", the KV cache over "cp".

Responsible for:
  - `ParallelRunner`, what rank 0's `Engine` calls in place of its `ModelRunner`: each step it sends the
    `StepInput` (plain data, as JSON) to every rank (over "cp", then over "tp"), runs its own part of the
    step, and returns the full logits; `run_worker`, the loop of the other ranks (receive a step, run it,
    take part in its collectives, until rank 0 says stop).
  - tensor parallelism (`shard_for_serving`): the training's transform without sequence parallelism
    (`apply_tensor_parallel`): attention heads, MLP columns and the vocabulary split over tp, so each
    rank's paged KV cache holds only its kv heads (the same memory per rank holds tp times the tokens);
    the vocab-parallel logits are all-gathered.
  - context parallelism (`SplitKVAttention`): a sequence's j-th KV block lives on cp rank j % cp (the
    block manager's groups), so every rank holds ~1/cp of every long sequence and a sequence longer than
    one rank's cache is served. Each new token is computed by the rank that holds its KV slot (its
    block's owner), so a prefill is split over the ranks block by block and a decode token runs on one
    rank (the weights are whole on every cp rank). Per layer: each rank writes the keys/values it
    computed into its own blocks; one all-gather of the queries; every rank attends all queries over its
    own blocks -- a partial result and its log-sum-exp -- and one all-gather of (output, lse) lets each
    owner merge its queries' partials exactly (`parallel.context.merge_partials`'s arithmetic); the
    sampled rows' hidden states reach every rank by one all-reduce. Keys never move, only queries and
    partials (not the training's ring: the keys here sit in the block layout, not the ring's chunks).
The scheduler, block manager and sampler live on rank 0 alone (torch-free and unchanged apart from the
groups); the other ranks never see a request.
Not responsible for: launching ranks (`meshlm generate --tp N --cp M` starts them through torch's
launcher; under torchrun every rank builds `LLM(..., tp=N, cp=M)`), scheduling or sampling.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from meshlm import comm
from meshlm.infer.model_runner import GatherBuffers, ModelRunner, StepInput, block_rows, write_kv
from meshlm.mesh import Mesh
from meshlm.models.moe import MoE
from meshlm.models.transformer import Transformer

_STOP = {"stop": True}


def shard_for_serving(model: Transformer, mesh: Mesh) -> Transformer:
    """`model` (the full weights, the same on every rank) split in place over "tp" for inference."""
    if mesh.size("tp") == 1:
        return model
    from meshlm.parallel.tensor import apply_tensor_parallel, check_tensor_parallel

    tp = mesh.size("tp")
    check_tensor_parallel(model.config, tp, sequence_parallel=False)
    num = model.config.num_experts
    if model.config.is_moe and num % tp != 0:  # checked before the model is touched
        choices = ",".join(str(d) for d in range(1, num + 1) if num % d == 0)
        raise ValueError(f"model.num_experts={num} is not divisible by tp={tp} (serving splits the experts "
                         f"over the tp ranks); choose tp in {{{choices}}}")
    model = apply_tensor_parallel(model, mesh, sequence_parallel=False)
    return split_experts(model, mesh)


def split_experts(model: Transformer, mesh: Mesh) -> Transformer:
    """Every MoE layer of `model` with its experts split over the tp ranks (in place; a dense model is
    returned as it is). Inference is dropless (`ModelRunner` turns the capacity rule off), so each token
    reaches its top-k experts whichever rank holds them. num_experts must be divisible by tp
    (`shard_for_serving` checks it; `apply_expert_parallel` refuses otherwise)."""
    from meshlm.parallel.expert import AXIS, apply_expert_parallel

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    tp = mesh.size("tp")
    if not moes or tp == 1:
        return model
    # The tp group itself is the expert group: no new process group; its traffic is counted as "ep".
    ep_mesh = mesh.with_axes({AXIS: (mesh.ranks("tp"), mesh.group("tp"))})
    apply_expert_parallel(model, ep_mesh)
    for moe in moes:
        # An instance attribute shadows MoE.forward (as apply_expert_parallel does for the experts).
        moe.forward = functools.partial(_moe_on_own_tokens, moe, mesh=ep_mesh)
    return model


def _moe_on_own_tokens(moe: MoE, x: torch.Tensor, *, mesh: Mesh) -> torch.Tensor:
    """The MoE of `x` (the same on every rank of the group): each rank routes and dispatches a contiguous
    1/n of the tokens (the last ranks may have fewer, or none), then the outputs are all-gathered."""
    from meshlm.parallel.expert import AXIS

    shape = x.shape
    x_td = x.reshape(-1, shape[-1])
    tokens, n, me = x_td.shape[0], mesh.size(AXIS), mesh.local_rank(AXIS)
    per = -(-tokens // n)
    mine = MoE.forward(moe, x_td[me * per:(me + 1) * per])
    # Padded to the same rows on every rank: all_gather moves equal shares.
    out = comm.all_gather(F.pad(mine, (0, 0, 0, per - mine.shape[0])), mesh, AXIS, dim=0)
    return out[:tokens].reshape(shape)


def _send(message, mesh: Mesh):
    """Rank 0's `message` on every rank: over its cp group, then each of those over its tp group."""
    if mesh.local_rank("tp") == 0:
        message = comm.broadcast_json(message, mesh, "cp")
    return comm.broadcast_json(message, mesh, "tp")


def _run_step(runner: ModelRunner, mesh: Mesh, step: StepInput) -> torch.Tensor:
    """This rank's part of a step, then the full logits (every tp rank's vocab slice, in order)."""
    return comm.all_gather(runner.execute(step), mesh, "tp", dim=1)


class ParallelRunner:
    """Rank 0's runner: the interface of `ModelRunner` (block_size, num_blocks, execute) over every rank;
    `num_blocks` counts the blocks of all cp ranks, `num_groups` tells the block manager where they are."""

    def __init__(self, runner: ModelRunner, mesh: Mesh):
        assert mesh.rank == 0, "rank 0 drives; the others run `run_worker`"
        self.runner, self.mesh = runner, mesh
        self.block_size = runner.block_size
        self.num_groups = mesh.size("cp")
        self.num_blocks = runner.num_blocks * self.num_groups
        self.closed = False

    def execute(self, step: StepInput) -> torch.Tensor:
        _send(dataclasses.asdict(step), self.mesh)
        return _run_step(self.runner, self.mesh, step)

    def close(self) -> None:
        """Release the other ranks from `run_worker` (once; the engine is unusable afterwards)."""
        if not self.closed:
            _send(_STOP, self.mesh)
            self.closed = True


def run_worker(runner: ModelRunner, mesh: Mesh) -> int:
    """A rank other than 0: run the steps rank 0 sends until it closes; return how many ran."""
    steps = 0
    while True:
        message = _send(None, mesh)
        if message == _STOP:
            return steps
        _run_step(runner, mesh, StepInput(**message))
        steps += 1


def split_kv_attention(mesh: Mesh):
    """The `attention` class a `ModelRunner` of a cp rank uses (bound to its mesh)."""
    def make(k_caches, v_caches, step, block_size, *, dtype, buffers=None):
        return SplitKVAttention(k_caches, v_caches, step, block_size, dtype=dtype, buffers=buffers, mesh=mesh)
    return make


class SplitKVAttention:
    """The attention context of one step on one cp rank: its blocks only, partials merged over "cp".

    The step's block tables hold global block ids; block b is this rank's local block b // cp when
    b % cp == its cp coordinate."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], step: StepInput, block_size: int,
                 *, dtype: torch.dtype, buffers: GatherBuffers | None, mesh: Mesh):
        self.k_caches, self.v_caches, self.mesh = k_caches, v_caches, mesh
        self.buffers = buffers or GatherBuffers()
        device = k_caches[0].device
        cp, me = mesh.size("cp"), mesh.local_rank("cp")
        # Each new token is computed by the rank that holds its KV slot: its block's owner. So a prefill is
        # split over the ranks block by block and every key/value is written where it is computed.
        owners = [(slot // block_size) % cp for slot in step.slot_mapping]
        self.rows_of = [[row for row, o in enumerate(owners) if o == r] for r in range(cp)]
        self.local_rows = torch.tensor(self.rows_of[me], dtype=torch.long, device=device)
        self.write_slots = torch.tensor([(step.slot_mapping[row] // block_size) // cp * block_size
                                         + step.slot_mapping[row] % block_size for row in self.rows_of[me]],
                                        dtype=torch.long, device=device)
        self.num_rows = len(step.token_ids)
        self.cp, self.me = cp, me
        # The rows whose logits are wanted, and which of them this rank computes (at which local index).
        where = {row: i for i, row in enumerate(self.rows_of[me])}
        self.sampled_here = [(i, where[row]) for i, row in enumerate(step.logits_indices) if row in where]
        self.num_sampled = len(step.logits_indices)
        # Per sequence: (first row, new tokens, this rank's local blocks, additive mask [new, keys]).
        self.seqs = []
        start = 0
        for n, length, table in zip(step.query_lens, step.context_lens, step.block_tables):
            used = -(-length // block_size)
            local = [(j, b // cp) for j, b in enumerate(table[:used]) if b % cp == me]
            if local:
                keys = torch.cat([torch.arange(j * block_size, (j + 1) * block_size) for j, _ in local])
                queries = torch.arange(length - n, length)
                visible = (keys[None, :] <= queries[:, None]) & (keys[None, :] < length)
                mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))
                blocks = torch.tensor([b for _, b in local], dtype=torch.long)
                rows = block_rows(blocks, k_caches[0].shape[0], k_caches[0].shape[1])
                self.seqs.append((start, n, rows.to(device), mask.to(device)))
            start += n

    def attend(self, layer: int, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        assert q_bhsd.shape[2] == len(self.rows_of[self.me]), "the runner must pass this rank's tokens only"
        if self.write_slots.numel():  # the keys/values of this rank's tokens, into its own blocks
            write_kv(k_cache, v_cache, self.write_slots, k_bhsd[0], v_bhsd[0])
        heads, dim = q_bhsd.shape[1], q_bhsd.shape[-1]
        num_kv = k_bhsd.shape[1]
        groups = heads // num_kv
        # Every rank attends every query over its own keys: the queries of all ranks, in step order (padded
        # to the most any rank has, for one all-gather).
        most = max(map(len, self.rows_of))
        mine = q_bhsd.new_zeros(heads, most, dim)
        mine[:, :q_bhsd.shape[2]] = q_bhsd[0]
        every = comm.all_gather(mine[None], self.mesh, "cp", dim=0)  # [cp, heads, most, dim]
        q_all = q_bhsd.new_empty(heads, self.num_rows, dim)
        for r, rows in enumerate(self.rows_of):
            q_all[:, rows] = every[r, :, :len(rows)]
        # This rank's partial: output and log-sum-exp per (head, row); rows that see none of its keys
        # keep lse = -inf and weigh nothing in the merge.
        out = q_bhsd.new_zeros(heads, self.num_rows, dim)
        lse = q_bhsd.new_full((heads, self.num_rows), float("-inf"))
        for start, n, rows, mask in self.seqs:
            q = q_all[:, start:start + n].reshape(num_kv, groups, n, dim)
            k, v = self.buffers.gather(k_cache, v_cache, rows)
            k = k[:, None].to(q.dtype)  # [kv_heads, 1, keys, dim]
            v = v[:, None].to(q.dtype)
            scores = torch.matmul(q, k.transpose(-1, -2)) * dim ** -0.5 + mask
            part_lse = torch.logsumexp(scores, dim=-1)  # [kv, groups, n]
            weights = torch.exp(scores - part_lse[..., None]).nan_to_num(0.0)  # a row with no visible key: 0
            out[:, start:start + n] = torch.matmul(weights, v).reshape(heads, n, dim)
            lse[:, start:start + n] = part_lse.reshape(heads, n)
        # One all-gather of (output, lse) over cp, then the exact merge of the partials.
        both = comm.all_gather(torch.cat([out, lse[..., None]], dim=-1)[None], self.mesh, "cp", dim=0)
        outs, lses = both[..., :dim], both[..., dim]
        outs, lses = outs[:, :, self.local_rows], lses[:, :, self.local_rows]  # this rank's queries only
        total = torch.logsumexp(lses, dim=0)  # [heads, rows]
        scale = torch.exp(lses - total).nan_to_num(0.0)
        merged = (outs * scale[..., None]).sum(dim=0)
        return merged[None].to(q_bhsd.dtype)

    def select_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states of the sampled rows [num_sampled, hidden] on every rank, from the ranks that
        computed them (`h`: this rank's rows, [1, local rows, hidden]): one all-reduce over cp."""
        out = h.new_zeros(self.num_sampled, h.shape[-1])
        for i, local in self.sampled_here:
            out[i] = h[0, local]
        return comm.all_reduce(out, self.mesh, "cp")
