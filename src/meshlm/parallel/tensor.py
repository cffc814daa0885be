"""Tensor parallelism (Megatron column/row split) with optional sequence parallelism, over mesh axis "tp".

Responsible for: `apply_tensor_parallel`, an in-place transform of the reference `Transformer` that
keeps every parameter name and shards
  attention  wq/wk/wv (and their Qwen2 biases) column-parallel by heads, wo row-parallel;
  MLP        w_gate/w_up column-parallel, w_down row-parallel (split along the intermediate dim);
  embedding  vocab-parallel (rows split; masked lookup, then a sum over the tp ranks);
  lm_head    column-parallel over the vocabulary: the model returns this rank's vocab slice of the
             logits, and `vocab_parallel_cross_entropy` computes the exact global loss from it, so
             full logits are never gathered in training;
and `vocab_parallel_cross_entropy` itself. Every sharded parameter carries `param._meshlm_shard =
("tp", dim)` (the mesh axis and the tensor dim it is split along, in coordinate order); parameters
without it are replicated over tp and hold the full gradient on every tp rank after backward.
It also gives the trainer what reads that metadata: `tensor_parallel_grad_norm` (sharded gradients
summed over tp, replicated ones counted once) and `full_state_dict` / `load_full_state_dict`
(the full weights, for tests and the end-of-training sample; checkpoints write each rank's shard at its
place instead, `meshlm.checkpoint.shards`).
Not responsible for: data parallelism over the other axes (`data.py`, `zero.py` then work on the
TP-local shards), splitting MoE layers (left whole and replicated on the tp ranks, the experts split by
expert parallelism; under SP each tp rank's MoE runs on its own chunk of the sequence and its gradients
are summed over tp, `sum_moe_grads_over_tp`; serving splits experts over the tp ranks,
`meshlm.infer.parallel.split_experts`), KV-cache generation under TP, and
the order of transforms (`parallelize.py` applies this one first).

Where the communication goes (n = tp degree; all through `meshlm.comm`, so every byte is counted):

  sequence_parallel=False: the residual stream is replicated on the tp ranks.
      column-parallel input:  copy_to_group        (fwd identity, bwd all-reduce of the input grad)
      row-parallel output:    reduce_from_group    (fwd all-reduce, bwd identity)
  sequence_parallel=True: the residual stream is split along the sequence (dim 1) over tp; RMSNorm
  runs on the local chunk, so its weight sees only local tokens and its gradient is all-reduced over tp.
      column-parallel input:  gather_along_dim     (fwd all-gather, bwd reduce-scatter)
      row-parallel output:    reduce_scatter_along_dim (fwd reduce-scatter, bwd all-gather)

Bytes per transformer layer, one forward + backward, fp32, activations [b, s, h] (CommStats
convention: all_gather counts its output, reduce_scatter its input, all_reduce the tensor):
  without SP:  4 all_reduce of 4*b*s*h bytes (2 forward, 2 backward)
  with SP:     4 all_gather and 4 reduce_scatter of 4*b*s*h bytes, plus 2 all_reduce of 4*h
               bytes (the gradients of attn_norm and mlp_norm)
  with qk_norm, both: plus 2 all_reduce of 4*head_dim bytes (q_norm, k_norm see only local heads).
  a MoE layer instead of the MLP: without SP, no traffic around it (replicated; its input gradient is
  whole on every rank); with SP, in forward one all_reduce of 4 x (num_experts + 1) bytes (the
  balancing counts, `expert.balance_over`), in backward one all_reduce per MoE parameter of its local
  size (its gradient) -- the experts' own traffic is on "ep" (expert.py).
Around the layers: the embedding (all_reduce of 4*b*s*h without SP / reduce_scatter with SP, its
backward free / all-gather), under SP the final norm (one all_reduce of 4*h in backward), the lm_head
input (like a column-parallel input; a tied lm_head shares the embedding's shard), and the loss adds
3 all_reduce of 4*b*s bytes (max, sum of exponentials, target logit).

Initialisation is the reference's: each rank slices its shard out of the full tensors of the model
it is given, so tp=n starts from exactly the weights of tp=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh
from meshlm.models.moe import MoE
from meshlm.models.transformer import MLP, Attention, RMSNorm, Transformer
from meshlm.rules import check_tensor_parallel  # noqa: F401 (the refusals live there; re-exported)

AXIS = "tp"
_MARK = "_meshlm_tensor_parallel"


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Sharding the reference tensors
# --------------------------------------------------------------------------------------------


def _shard(param: nn.Parameter, mesh: Mesh, dim: int) -> nn.Parameter:
    """This rank's chunk of the full `param` along `dim`, as a new Parameter tagged with its layout."""
    n, c = mesh.size(AXIS), mesh.local_rank(AXIS)
    assert param.shape[dim] % n == 0, (tuple(param.shape), dim, n)
    shard = nn.Parameter(param.detach().chunk(n, dim=dim)[c].clone(), requires_grad=param.requires_grad)
    shard._meshlm_shard = (AXIS, dim)
    return shard


def _column_parallel(linear: nn.Linear, mesh: Mesh) -> None:
    """Split the output features (weight rows, bias) over tp: each rank computes its slice of the output."""
    linear.weight = _shard(linear.weight, mesh, 0)
    if linear.bias is not None:
        linear.bias = _shard(linear.bias, mesh, 0)
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, mesh: Mesh) -> None:
    """Split the input features over tp: each rank computes a partial sum of the whole output."""
    # A bias would be added n times by the reduction; the reference has none on wo/w_down.
    assert linear.bias is None
    linear.weight = _shard(linear.weight, mesh, 1)
    linear.in_features = linear.weight.shape[1]


# --------------------------------------------------------------------------------------------
# Layers that need a forward of their own
# --------------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding on each rank; other ids look up zeros; the sum over tp is exact."""

    def __init__(self, embed: nn.Embedding, mesh: Mesh, *, sequence_parallel: bool):
        super().__init__()
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.weight = _shard(embed.weight, mesh, 0)
        rows = self.weight.shape[0]
        self.vocab_start = mesh.local_rank(AXIS) * rows
        self.vocab_end = self.vocab_start + rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = self.mesh.size(AXIS)
        if self.sequence_parallel and tokens.shape[1] % n != 0:
            raise ValueError(f"sequence length {tokens.shape[1]} is not divisible by tp={n} (sequence "
                             f"parallelism splits the sequence over the tp ranks); use a sequence length "
                             f"that is a multiple of {n}, or turn sequence parallelism off")
        inside = (tokens >= self.vocab_start) & (tokens < self.vocab_end)
        local_ids = torch.where(inside, tokens - self.vocab_start, torch.zeros_like(tokens))
        # Zeroing the rows of foreign ids also zeroes their gradient into row 0.
        partial = F.embedding(local_ids, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        if self.sequence_parallel:
            return comm.reduce_scatter_along_dim(partial, self.mesh, AXIS, dim=1)
        return comm.reduce_from_group(partial, self.mesh, AXIS)


class GradReducedRMSNorm(RMSNorm):
    """RMSNorm whose input is only part of what the reference normalises (a sequence chunk, or some
    heads): the weight goes through copy_to_group, so its gradient is all-reduced over tp in backward.

    Doing it in the graph rather than in a gradient hook keeps gradient accumulation right: each
    backward reduces its own contribution once.
    """

    def __init__(self, norm: RMSNorm, mesh: Mesh):
        nn.Module.__init__(self)
        self.eps, self.weight, self.mesh = norm.eps, norm.weight, mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return comm.copy_to_group(self.weight, self.mesh, AXIS) * x.to(dtype)


# --------------------------------------------------------------------------------------------
# The communication around a parallel region (forward hooks, so module and parameter names stay)
# --------------------------------------------------------------------------------------------


def _enter_region(mesh: Mesh, sequence_parallel: bool):
    """Pre-hook on a module whose first argument feeds column-parallel layers."""

    def hook(module, args):
        x = args[0]
        if sequence_parallel:
            x = comm.gather_along_dim(x, mesh, AXIS, dim=1, grad_op="reduce_scatter")
        else:
            x = comm.copy_to_group(x, mesh, AXIS)
        return (x, *args[1:])

    return hook


def _leave_region(mesh: Mesh, sequence_parallel: bool):
    """Forward hook on a module whose output is a row-parallel partial sum."""

    def hook(module, args, out):
        if sequence_parallel:
            return comm.reduce_scatter_along_dim(out, mesh, AXIS, dim=1)
        return comm.reduce_from_group(out, mesh, AXIS)

    return hook


def _full_positions(module, args, kwargs):
    """Under SP the hidden states are a sequence chunk, but RoPE (applied after the all-gather)
    needs the positions of the whole sequence, which the reference derives from the hidden width."""
    if kwargs.get("positions") is None:
        tokens, cache = args[0], kwargs.get("cache")
        start = cache.length if cache is not None else 0
        kwargs["positions"] = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    return args, kwargs


# --------------------------------------------------------------------------------------------
# The transform
# --------------------------------------------------------------------------------------------


def apply_tensor_parallel(model: Transformer, mesh: Mesh, *, sequence_parallel: bool = True) -> Transformer:
    """Shard `model` over the mesh's "tp" axis in place (parameter names unchanged) and return it.

    Afterwards `model(tokens)` takes the full [batch, seq] tokens (the same on every tp rank) and
    returns this rank's vocab slice of the logits, [batch, seq, vocab / tp]; compute the loss with
    `vocab_parallel_cross_entropy`. With `sequence_parallel`, seq must be divisible by tp.
    Raises ValueError, before changing anything, for head counts / sizes tp does not divide, MoE
    layers, or a model transformed already. tp == 1 leaves the model untouched.
    """
    tp = mesh.size(AXIS)
    if getattr(model, _MARK, False):
        raise ValueError("apply_tensor_parallel was applied to this model already; build a fresh model")
    check_tensor_parallel(model.config, tp, sequence_parallel=sequence_parallel)
    if tp == 1:
        return model
    setattr(model, _MARK, True)
    # A pipeline stage (meshlm.parallel.pipeline) may lack the embedding or the norm and head (None).
    tied = model.lm_head is not None and model.embed is not None and model.lm_head.weight is model.embed.weight

    if model.embed is not None:
        model.embed = VocabParallelEmbedding(model.embed, mesh, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        model.register_forward_pre_hook(_full_positions, with_kwargs=True)

    for block in model.layers.values():
        attn: Attention = block.attn
        for linear in (attn.wq, attn.wk, attn.wv):
            _column_parallel(linear, mesh)
        _row_parallel(attn.wo, mesh)
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
        if attn.q_norm is not None:  # one weight shared by all heads, each rank sees only its own heads
            attn.q_norm = GradReducedRMSNorm(attn.q_norm, mesh)
            attn.k_norm = GradReducedRMSNorm(attn.k_norm, mesh)
        attn.register_forward_pre_hook(_enter_region(mesh, sequence_parallel))
        attn.register_forward_hook(_leave_region(mesh, sequence_parallel))

        mlp = block.mlp
        if sequence_parallel:
            block.attn_norm = GradReducedRMSNorm(block.attn_norm, mesh)
            block.mlp_norm = GradReducedRMSNorm(block.mlp_norm, mesh)
        if isinstance(mlp, MoE):
            # Replicated on the tp ranks, the experts split over "ep" instead (expert.py). Without SP every
            # tp rank routes the same whole sequence; with SP each routes its own chunk, no gather: the
            # gradients are then partial sums (`sum_moe_grads_over_tp`), and the load-balancing loss's
            # counts are summed over tp (`expert.balance_over`).
            continue
        assert isinstance(mlp, MLP)
        _column_parallel(mlp.w_gate, mesh)
        _column_parallel(mlp.w_up, mesh)
        _row_parallel(mlp.w_down, mesh)
        mlp.register_forward_pre_hook(_enter_region(mesh, sequence_parallel))
        mlp.register_forward_hook(_leave_region(mesh, sequence_parallel))

    if sequence_parallel and model.norm is not None:
        model.norm = GradReducedRMSNorm(model.norm, mesh)
    if model.lm_head is None:
        return model
    if tied:
        model.lm_head.weight = model.embed.weight
        model.lm_head.out_features = model.embed.weight.shape[0]
    else:
        _column_parallel(model.lm_head, mesh)
    model.lm_head.register_forward_pre_hook(_enter_region(mesh, sequence_parallel))
    return model


def sum_moe_grads_over_tp(model: nn.Module, mesh: Mesh) -> None:
    """Under sequence parallelism each tp rank's MoE layers (router, experts, shared experts: replicated
    over tp) see only its chunk of the sequence, so its gradients are that chunk's part: sum them over tp.

    A hook on each parameter sums every backward's gradient before it is accumulated (so gradient
    accumulation and the data-parallel hooks, which run after accumulation, see whole gradients); the
    weights are used inside expert dispatch, where no `copy_to_group` of the weight (as
    `GradReducedRMSNorm` does) can be placed. Call it on the parameters the step will use (after
    `materialize` replaced any meta ones). One all_reduce per MoE parameter and backward, over tp.
    """
    if mesh.size(AXIS) == 1:
        return
    for moe in model.modules():
        if isinstance(moe, MoE):
            for p in moe.parameters():
                if p.requires_grad:
                    p.register_hook(lambda g: comm.all_reduce(g.clone(memory_format=torch.contiguous_format),
                                                             mesh, AXIS))


# --------------------------------------------------------------------------------------------
# Vocab-parallel cross entropy
# --------------------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token -log softmax(logits)[target] from vocab slices, with the exact global normaliser."""

    @staticmethod
    def forward(ctx, logits_local, targets, mesh, axis, ignore_index):
        logits = logits_local.to(torch.promote_types(logits_local.dtype, torch.float32))
        rows = logits.shape[-1]
        start = mesh.local_rank(axis) * rows
        # Subtracting the global max keeps exp() in range exactly as a one-device log_softmax does.
        global_max = logits.max(dim=-1).values.contiguous()
        comm.all_reduce(global_max, mesh, axis, op="max")
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1).contiguous()
        comm.all_reduce(sum_exp, mesh, axis)
        inside = (targets >= start) & (targets < start + rows)
        local_t = torch.where(inside, targets - start, torch.zeros_like(targets))
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside
        target_logit = target_logit.contiguous()
        comm.all_reduce(target_logit, mesh, axis)
        valid = targets != ignore_index
        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(exp, sum_exp, local_t, inside & valid, valid)
        ctx.input_dtype = logits_local.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_t, hit, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad = grad * (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor, mesh: Mesh, *,
                                 axis: str = AXIS, reduction: str = "mean",
                                 ignore_index: int = -100) -> torch.Tensor:
    """`F.cross_entropy` of the full logits, from this rank's vocab slice [..., vocab / n] (collective).

    `targets` [...] are global token ids, the same on every rank of `axis`; the result is the same
    on every rank. reduction "mean" averages over the targets that are not `ignore_index`.
    Moves 3 all-reduces of one float per token (max, sum of exponentials, target logit).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    if logits_local.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits_local.shape)} and targets {tuple(targets.shape)} must agree "
                         "on every dim but the last (the vocab slice)")
    loss = _VocabParallelCrossEntropy.apply(logits_local, targets, mesh, axis, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum()


# --------------------------------------------------------------------------------------------
# What the trainer needs: gradient norm and layout-independent checkpoints
# --------------------------------------------------------------------------------------------


def tensor_parallel_grad_norm(params, mesh: Mesh, *, axes: tuple[str, ...] = (AXIS,)) -> torch.Tensor:
    """Global L2 norm of the gradients of `params` (collective over each of `axes`; one float each).

    A sharded gradient (`_meshlm_shard = (axis, dim)` on its parameter) contributes its squares from
    every rank of its axis ("tp"; expert parallelism's "ep"); a replicated one holds the full gradient on
    every rank and is counted once. Every axis in `axes` is reduced (so every rank joins the same
    collectives), whether or not this rank holds a shard of it.
    """
    grads = [(p, p.grad.detach()) for p in params if p.grad is not None]
    # fp32 sums (bf16 and fp32 gradients); fp64 under train.precision=fp64
    dtype = torch.promote_types(grads[0][1].dtype, torch.float32) if grads else torch.float32
    device = grads[0][1].device if grads else torch.device("cpu")
    # summed where the gradients are: no copy to the host (a GPU sync) per parameter
    sharded = {axis: torch.zeros((), dtype=dtype, device=device) for axis in axes}
    replicated = torch.zeros((), dtype=dtype, device=device)
    for p, g in grads:
        sq = torch.linalg.vector_norm(g, dtype=dtype) ** 2
        shard = getattr(p, "_meshlm_shard", None)
        if shard is not None:
            assert shard[0] in sharded, f"a gradient sharded over {shard[0]!r}, not in {axes}"
            sharded[shard[0]] = sharded[shard[0]] + sq
        else:
            replicated = replicated + sq
    total = replicated
    for axis, sq in sharded.items():
        total = total + comm.all_reduce(sq.reshape(1).contiguous(), mesh, axis)[0]
    return total.sqrt()


@torch.no_grad()
def full_state_dict(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """The reference model's state dict (same keys, full tensors) on every rank; collective over tp."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shard = getattr(t, "_meshlm_shard", None)
        if shard is None:
            out[name] = t.detach().clone()
        else:
            axis, dim = shard
            out[name] = comm.all_gather(t.detach().contiguous(), mesh, axis, dim=dim).clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], mesh: Mesh) -> None:
    """Copy full (reference-layout) tensors into the model, each rank keeping its own shard; no communication."""
    own = model.state_dict(keep_vars=True)
    missing, unexpected = set(own) - set(state), set(state) - set(own)
    if missing or unexpected:
        raise ValueError(f"state dict keys differ from the model's: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    for name, t in own.items():
        full = state[name]
        shard = getattr(t, "_meshlm_shard", None)
        if shard is not None:
            axis, dim = shard
            full = full.chunk(mesh.size(axis), dim=dim)[mesh.local_rank(axis)]
        if full.shape != t.shape:
            raise ValueError(f"{name}: the state dict holds shape {tuple(state[name].shape)}, which does not "
                             f"give this rank's shape {tuple(t.shape)}; was it saved from another model config?")
        t.copy_(full)
