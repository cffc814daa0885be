"""Context parallelism: every sequence split over the "cp" ranks, attention computed across them.

Responsible for: the load-balanced causal split of a sequence (`shard_sequence`, `local_positions`),
ring attention (`ring_attention`: key/value blocks passed around the cp ranks, partial results merged
by log-sum-exp, backward as a ring; its forward loop, `ring_pass`, is also context-parallel serving's),
the all-gather variant (`allgather_attention`: K/V gathered once per layer), Ulysses (`ulysses_attention`:
heads instead of tokens split over cp for the attention, by two all-to-alls) and the hybrid of the ring and
Ulysses (`hybrid_attention`: Ulysses within groups of cp ranks, the ring across them), the one log-sum-exp merge
of partial attention results (`merge_partials`, which serving's ring and split-KV decoding reuse), and
`apply_context_parallel`, which swaps every attention's core for one of them.
Not responsible for: the loss normalisation (the trainer: every rank's token-loss sum over the global
token count, summed over "dp_cp"), the gradient reduction of the replicated parameters over "dp_cp"
(`parallel/data.py` and `parallel/zero.py` are handed that axis), or RoPE (the model rotates q and k by
the positions it is given: the trainer passes this rank's true positions, `ContextParallel.positions`).

The split. With cp ranks the sequence is cut into 2*cp equal chunks and rank i holds chunks i and
2*cp-1-i, in that order: under the causal mask chunk j attends to j+1 chunks, so every rank attends
to (i+1) + (2cp-i) = 2cp+1 chunks' worth, the same work everywhere (a plain split into cp pieces
would leave the last rank cp times the first's). seq_len must divide by 2*cp.

Ring attention (forward). Each rank starts with its own K/V (both chunks, only the kv heads: GQA's
query heads share them and are expanded locally); for cp steps it attends its queries to the block in
hand while the block moves on to the next rank (`comm.batch_isend_irecv`, posted before the compute
so the transfer overlaps it). That loop is `ring_pass`, which takes what to do with the block in hand
as a callable: context-parallel serving's prefill (`infer/parallel.py`) runs the same loop over its own
blocks (the paged cache's keys, causal by position). Per (query chunk, key chunk) pair the causal mask
is decided by chunk index: an earlier key chunk is attended in full, the same chunk causally, a later
one not at all (the pair is skipped, no FLOPs). Each pair gives a partial output and its log-sum-exp
(`parallel/pair_attention.py`: a fused kernel in the inputs' dtype where PyTorch has one, else explicit);
`merge_partials` combines them exactly (online softmax). Saved for backward: this rank's q, k, v, the
output and the log-sum-exp -- 1/cp of the sequence's, whatever cp is.

Ring attention (backward). The K/V blocks go round again; for each block every rank computes its
queries' share of dK/dV (and its own dQ) from the saved output and log-sum-exp (the FlashAttention
backward), and the partial dK/dV of a block travel with it, summed rank by rank, and reach the owner
after the last step. Volume per rank and layer, exact (`CommStats` "send" on "cp"): forward (cp-1)
blocks of K+V; backward (cp-1) blocks of K+V plus (cp-1) blocks of dK+dV (the owner's own share stays
put, so the partial sums make cp-1 hops, not cp). The partial sums travel in the compute dtype (fp32
under bf16 autocast, for accuracy), K/V in theirs.

All-gather (parallel.cp_method=allgather, Llama 3 style): K and V of every rank gathered once per
layer (one all-gather over "cp", the output counted: cp blocks of K+V), then the ring's per-chunk-pair
attention over the gathered blocks (no mask tensor: a boolean mask would make SDPA keep a float
[s/cp, s] mask per layer, quadratic in the sequence); backward reduce-scatters dK/dV (cp blocks in).
Fewer, larger messages and no ring steps -- better for short sequences; it keeps the whole sequence's
K/V (kv heads) per layer for backward, where the ring keeps 1/cp.

Ulysses (parallel.cp_method=ulysses, DeepSpeed-Ulysses): the sequence stays split as above, but attention
is split by heads instead. One all-to-all over "cp" turns this rank's q, k, v [b, heads, s/cp, d] into
the whole sequence of heads/cp of them (q, k and v packed in one message); the tokens are put back in
sequence order (the split's chunks are not contiguous), ordinary causal attention runs over the whole
sequence on the local heads (`_causal_core`, the model's own core: GQA expansion and SDPA), and a second
all-to-all returns the output to this rank's tokens, all heads, for the output projection. The heads are
those of this tp rank (tensor parallelism splits them first). GQA: the kv heads must split over cp too;
where cp does not divide them they are replicated first to lcm(kv_heads, cp) (each copy next to the query
heads that read it), so every rank gets the kv heads its query heads need (`check_ulysses` refuses heads
that cp does not divide). What it keeps for backward is what the model's own core keeps, per local token
the same as without cp (heads/cp over the whole sequence); no communication overlaps compute.
Volume per rank and layer, exact (`CommStats` "all_to_all" on "cp" counts a rank's whole input, its own
slice included), with T = b x s/cp tokens on this rank, d = head_dim, E the element size, h = num_heads /
tp and g = lcm(num_kv_heads / tp, cp) the kv heads after replication:
    forward   T d E (h + 2g)  (q, k, v)  +  T d E h  (the output)
    backward  the same again (the inverse exchanges of the gradients)
so 4 T d E (h + g) per layer and micro-batch. Recomputation repeats forward exchanges: full both, selective
only q, k, v's (its checkpoint stops once the core's saved tensors are back, and nothing after the output's
exchange is kept inside the core), T d E (h + 2g) more.

The hybrid (USP: parallel.cp_ulysses = U > 1, with cp_method=ring; `hybrid_mesh`, `hybrid_attention`): the
cp ranks form cp / U groups of U consecutive ranks ("cp_ulysses"); Ulysses' all-to-all inside each group
gives a rank heads / U of the group's 2U chunks, the ring runs across the groups ("cp_ring", the ranks at the
same place in every group; `ring_pass` unchanged, the causal mask by chunk index over a group's chunks), and
the all-to-all back returns the output. Per rank and layer, with T, d, E, h as above, g = lcm(num_kv_heads /
tp, U) and R = cp / U: on "cp_ulysses" Ulysses' 4 T d E (h + g) (U in place of cp); on "cp_ring" the ring's
volume for a block of K (or V) of T d E g bytes (the group's U T tokens at g / U heads): forward (R-1) x K+V,
backward (R-1) x (K+V + dK+dV), each sent and received. U = cp is Ulysses over a ring of one.

Document masking (data.document_mask): every variant takes `documents`, the whole sequences' document ids
[b, seq] (`meshlm.models.documents`; not split: every rank has the whole micro-batch, so knowing the documents
of the K/V chunks a rank meets costs no communication, and the collectives are exactly those without it).
The ring and all-gather mask each (query chunk, key chunk) pair by chunk index as before and, within it, by
document (`attention_mask` of the two chunks' slices of `documents`); a pair whose queries see none of its keys
in any sequence is skipped like a later chunk. A query row may see no key of a pair (another document): its
scores are filled with the dtype's lowest finite value, not -inf, so the pair's partial result is finite and its
weight in the merge, exp(lse_pair - lse), is exactly 0 once a pair holding the query's own document (its own
chunk, at least) is merged -- and the backward's probabilities there are exactly 0 too. Ulysses and the hybrid
put the tokens back in sequence order, where the model's core takes `documents` as they are.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from meshlm import comm
from meshlm.comm import P2P
from meshlm.mesh import Mesh, create_groups, every_group, group_ranks
from meshlm.models.documents import attention_mask
from meshlm.parallel.pair_attention import compute_dtype, pair_backward, pair_forward
from meshlm.rules import CP_METHODS, check_hybrid, check_seq_len, check_ulysses, ulysses_kv_heads  # noqa: F401

AXIS = "cp"
# The hybrid (parallel.cp_ulysses = U > 1): "cp" seen as cp / U groups of U consecutive ranks.
ULYSSES_AXIS = "cp_ulysses"  # the U ranks of this rank's group (the all-to-alls)
RING_AXIS = "cp_ring"  # the cp / U ranks at this rank's place in every group (the ring)
METHODS = CP_METHODS  # parallel.cp_method: ring, allgather, ulysses


# --------------------------------------------------------------------------------------------
# The load-balanced split
# --------------------------------------------------------------------------------------------


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, *, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The true positions of the tokens rank `cp_rank` holds (RoPE rotates by these), int64 [seq_len / cp]."""
    check_seq_len(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in chunk_ids(cp_rank, cp)])


def shard_sequence(x: torch.Tensor, *, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (tokens, targets, hidden states), concatenated."""
    if cp == 1:
        return x
    check_seq_len(x.shape[dim], cp)
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, j * c, c) for j in chunk_ids(cp_rank, cp)], dim=dim)


def unshard_sequence(x_local: torch.Tensor, mesh: Mesh, *, dim: int = 1, axis: str = AXIS) -> torch.Tensor:
    """The whole sequence from every rank's `shard_sequence` piece (an all-gather; for tests and tools)."""
    cp = mesh.size(axis)
    if cp == 1:
        return x_local
    return _to_sequence_order(comm.all_gather(x_local.contiguous(), mesh, axis, dim=dim).chunk(cp, dim=dim), cp, dim)


# --------------------------------------------------------------------------------------------
# Partial attention and its merge
# --------------------------------------------------------------------------------------------


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets into the result over their union.

    `out_*` [..., seq, head_dim] are softmax-weighted sums over each key set, `lse_*` [..., seq] the
    log-sum-exp of each set's scores. Exact: the union's softmax reweights each part by
    exp(lse_part - lse_union)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out, lse


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads -> query heads (GQA): head h of the queries reads kv head h // groups."""
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: the query heads' gradients summed onto their kv head."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def _pairs(q_ids, k_ids, c: int, documents: torch.Tensor | None = None):
    """(query slice, key slice, causal, allowed) for every (query chunk, key chunk) pair that is not fully
    masked, for queries holding chunks `q_ids` (in that order, `c` tokens each) against a block holding `k_ids`.
    `allowed`: with `documents` (the whole sequences', [b, 2 cp c]) the pair's mask [b, c, c], else None."""
    for qi, qa in enumerate(q_ids):
        for ki, kb in enumerate(k_ids):
            if kb > qa:
                continue
            allowed = None
            if documents is not None:
                allowed = attention_mask(documents[:, qa * c:(qa + 1) * c], documents[:, kb * c:(kb + 1) * c],
                                         causal=kb == qa)
                if not allowed.any():  # other documents only
                    continue
            yield slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), kb == qa, allowed


def _shape(q: torch.Tensor, k: torch.Tensor, q_ids) -> tuple[int, int, float]:
    """(GQA group size, chunk length, softmax scale) of this rank's q [b, h, n c, d] (n = len(q_ids)
    chunks) and k [b, hkv, n c, d]."""
    return q.shape[1] // k.shape[1], q.shape[2] // len(q_ids), 1.0 / math.sqrt(q.shape[-1])


def _accumulators(q: torch.Tensor):
    """(out, lse, aux) that `_block_forward` merges every pair into: the output in the compute dtype and q's memory
    layout (zeros_like keeps strides, so the model's transpose back to tokens stays a view), the log-sum-exp at
    -inf (no keys yet), and a list for the first pair's kernel aux."""
    cdt = compute_dtype(q.dtype)
    return torch.zeros_like(q, dtype=cdt), torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device), []


def _block_forward(q, block, *, q_ids, k_ids, out, lse, documents=None, aux: list | None = None) -> None:
    """Attend this rank's queries `q` (chunks `q_ids`) to the K/V `block` [2, b, hkv, n c, d] holding chunks
    `k_ids`, merging each (query chunk, key chunk) pair's partial result into `out` / `lse` (compute dtype) in
    place (the online softmax). `documents`: the whole sequences' document ids (block-causal), or None. `aux`: a
    list that receives the first pair's kernel aux (`pair_attention.CudaAux`) when it is empty."""
    groups, c, scale = _shape(q, block[0], q_ids)
    kb, vb = _expand(block[0].to(q.dtype), groups), _expand(block[1].to(q.dtype), groups)
    for qs, ks, causal, allowed in _pairs(q_ids, k_ids, c, documents):
        part, part_lse, pair_aux = pair_forward(q[:, :, qs], kb[:, :, ks], vb[:, :, ks], causal=causal,
                                                scale=scale, allowed=allowed)
        if aux is not None and pair_aux is not None and not aux:
            aux.append(pair_aux)
        # lse starts at -inf (no keys yet): merging with it keeps `part` exactly
        out[:, :, qs], lse[:, :, qs] = merge_partials(out[:, :, qs], lse[:, :, qs], part.to(out.dtype), part_lse)


def _block_backward(q, dout, block, *, q_ids, k_ids, out, lse, dq, documents=None, aux=None) -> torch.Tensor:
    """This rank's share of dK/dV of `block` (the K/V of chunks `k_ids`), [2, b, hkv, n c, d] in dq's dtype;
    adds its part of dQ into `dq`. `out`/`lse`: the whole attention's for this rank's queries (the
    FlashAttention backward: probabilities recomputed from the saved log-sum-exp)."""
    groups, c, scale = _shape(q, block[0], q_ids)
    kb, vb = _expand(block[0].to(q.dtype), groups), _expand(block[1].to(q.dtype), groups)
    dk, dv = kb.new_zeros(kb.shape, dtype=dq.dtype), vb.new_zeros(vb.shape, dtype=dq.dtype)
    for qs, ks, causal, allowed in _pairs(q_ids, k_ids, c, documents):
        gq, gk, gv = pair_backward(dout[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks], out[:, :, qs],
                                   lse[:, :, qs], causal=causal, scale=scale, allowed=allowed, aux=aux)
        dq[:, :, qs] += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
    return torch.stack([_fold(dk, groups), _fold(dv, groups)])


def ring_pass(block: torch.Tensor, mesh: Mesh, axis: str, visit, *, incoming=None) -> None:
    """Every rank's `block` travels round the ring over `axis`; `visit(block_in_hand, src)` is called once for
    each rank's block (`src`: its owner), this rank's own first, then ranks r-1, r-2, ... (cp calls, cp-1 hops).

    Each hop (send the block in hand to rank r+1, receive the next from rank r-1, `comm.batch_isend_irecv`,
    counted in `CommStats` as "send"/"recv" on `axis`) is posted before the visit, so the transfer overlaps
    the compute. `incoming(src)`: an empty buffer for rank `src`'s block (default: one like `block`, for rings
    whose blocks all have one shape); an empty block (no elements) is neither sent nor received, so a rank
    with nothing to contribute only relays. The one ring loop of training's `ring_attention` (chunk-index
    masks) and of context-parallel serving's prefill (position masks, `infer/parallel.py`)."""
    cp, r = mesh.size(axis), mesh.local_rank(axis)
    nxt, prv = (r + 1) % cp, (r - 1) % cp
    for step in range(cp):
        src = (r - step) % cp
        handle, arriving = None, None
        if step < cp - 1:  # the next block is on its way while this one is attended to
            arriving = torch.empty_like(block) if incoming is None else incoming((src - 1) % cp)
            ops = [P2P(kind, tensor, peer, tag=2 * step)
                   for kind, tensor, peer in (("send", block, nxt), ("recv", arriving, prv)) if tensor.numel()]
            handle = comm.batch_isend_irecv(ops, mesh, axis) if ops else None
        visit(block, src)
        if handle is not None:
            handle.wait()
        if arriving is not None:
            block = arriving


class _RingAttention(torch.autograd.Function):
    """q [b, h, s, d], k/v [b, hkv, s, d] (this rank's chunks, `chunks_of(rank on axis)`) -> out [b, h, s, d];
    `documents`: the whole sequences' document ids, or None."""

    @staticmethod
    def forward(ctx, q, k, v, mesh: Mesh, axis: str, chunks_of, documents=None):
        r = mesh.local_rank(axis)
        out, lse, aux = _accumulators(q)
        # what travels: the kv heads only
        ring_pass(torch.stack([k, v]).contiguous(), mesh, axis,
                  lambda block, src: _block_forward(q, block, q_ids=chunks_of(r), k_ids=chunks_of(src), out=out,
                                                    lse=lse, documents=documents, aux=aux))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.axis, ctx.chunks_of, ctx.documents = mesh, axis, chunks_of, documents
        ctx.aux = aux[0] if aux else None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, axis = ctx.mesh, ctx.axis
        cp, r = mesh.size(axis), mesh.local_rank(axis)
        cdt = lse.dtype
        nxt, prv = (r + 1) % cp, (r - 1) % cp
        dout = dout.to(q.dtype).contiguous()
        dq = torch.zeros_like(q, dtype=cdt)
        block = torch.stack([k, v]).contiguous()
        own = None  # this rank's share of its own block's dK/dV (it never leaves)
        outgoing = None  # the partial dK/dV summed at the last step, passed on with this step's exchange
        for step in range(cp + 1):
            # One group per step, as NCCL needs (a send completes only once its receive runs, and each
            # rank's groups run in order): the last step's partial sums go on to rank r+1 in the same
            # group that brings this step's from rank r-1, and the K/V blocks move on beside them.
            ops, incoming, partial_in = [], None, None
            if outgoing is not None:
                ops.append(P2P("send", outgoing, nxt, tag=2 * (step - 1) + 1))
            if step >= 2:  # the partial dK/dV of this step's block (at step cp: of this rank's own)
                partial_in = torch.empty((2, *k.shape), dtype=cdt, device=k.device)
                ops.append(P2P("recv", partial_in, prv, tag=2 * (step - 1) + 1))
            if step < cp - 1:
                incoming = torch.empty_like(block)
                ops += [P2P("send", block, nxt, tag=2 * step), P2P("recv", incoming, prv, tag=2 * step)]
            handle = comm.batch_isend_irecv(ops, mesh, axis) if ops else None
            if step == cp:  # the other ranks' shares of this rank's block have come home
                if handle is not None:
                    handle.wait()
                    own = own + partial_in
                break
            grads = _block_backward(q, dout, block, q_ids=ctx.chunks_of(r), k_ids=ctx.chunks_of((r - step) % cp),
                                    out=out, lse=lse, dq=dq, documents=ctx.documents, aux=ctx.aux)
            if handle is not None:
                handle.wait()
            if step == 0:
                own = grads
            else:
                outgoing = (grads + partial_in if partial_in is not None else grads).contiguous()
            if incoming is not None:
                block = incoming
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


class _GatheredAttention(torch.autograd.Function):
    """q [b, h, s, d] (this rank's chunks), kv [2, b, hkv, cp * s, d] (every rank's, in rank order) ->
    out [b, h, s, d]; no communication here (the gather's autograd reduce-scatters dK/dV). `documents`: the
    whole sequences' document ids, or None."""

    @staticmethod
    def forward(ctx, q, kv, cp_rank: int, cp: int, documents=None):
        s = q.shape[2]
        out, lse, aux = _accumulators(q)
        for src in range(cp):
            _block_forward(q, kv[:, :, :, src * s:(src + 1) * s], q_ids=chunk_ids(cp_rank, cp),
                           k_ids=chunk_ids(src, cp), out=out, lse=lse, documents=documents, aux=aux)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.cp_rank, ctx.cp, ctx.documents, ctx.aux = cp_rank, cp, documents, (aux[0] if aux else None)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        s = q.shape[2]
        dout = dout.to(q.dtype).contiguous()
        dq = torch.zeros_like(q, dtype=lse.dtype)
        dkv = torch.cat([_block_backward(q, dout, kv[:, :, :, src * s:(src + 1) * s],
                                         q_ids=chunk_ids(ctx.cp_rank, ctx.cp), k_ids=chunk_ids(src, ctx.cp),
                                         out=out, lse=lse, dq=dq, documents=ctx.documents, aux=ctx.aux)
                         for src in range(ctx.cp)], dim=3)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, *, axis: str = AXIS,
                   documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole (cp-split) sequence, by a ring over `axis`.

    q [b, heads, s, d]; k, v [b, kv_heads, s, d] -- this rank's two chunks (`shard_sequence`), already
    rotated by their true positions. `documents`: the whole sequences' document ids [b, cp s] (block-causal
    attention; the same on every rank). Returns [b, heads, s, d]. Collective over `axis`."""
    cp = mesh.size(axis)
    return _RingAttention.apply(q, k, v, mesh, axis, functools.partial(chunk_ids, cp=cp), documents)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, *,
                        axis: str = AXIS, documents: torch.Tensor | None = None) -> torch.Tensor:
    """`ring_attention`'s result with K/V gathered once (one all-gather forward, one reduce-scatter backward).

    The same per-chunk-pair attention as the ring (fully masked pairs skipped, no mask tensor), over the
    gathered blocks; it keeps the whole sequence's K/V (kv heads only) for backward."""
    kv = comm.gather_along_dim(torch.stack([k, v]).contiguous(), mesh, axis, dim=3, grad_op="reduce_scatter")
    return _GatheredAttention.apply(q, kv, mesh.local_rank(axis), mesh.size(axis), documents)


# --------------------------------------------------------------------------------------------
# Ulysses: all-to-all from sequence-split to head-split and back
# --------------------------------------------------------------------------------------------


def _causal_core(q_bhsd, k_bhsd, v_bhsd, documents=None):
    """`Attention.core` (the model's dense causal attention, GQA expanded; block-causal with `documents`):
    [b, h, s, d] -> [b, s, h * d]."""
    from meshlm.models.transformer import Attention  # models never import parallel; the reverse is fine

    return Attention.core(None, q_bhsd, k_bhsd, v_bhsd, documents)  # core reads nothing of its module


def _to_sequence_order(x, cp: int, dim: int) -> torch.Tensor:
    """Every rank's `shard_sequence` piece, x[rank] (a tensor's first dim or a sequence), -> their chunks
    in true token order, concatenated along `dim` (of a piece)."""
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank in range(cp):
        first, second = chunk_ids(rank, cp)
        chunks[first], chunks[second] = x[rank].chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _heads_exchange(q, k, v, mesh: Mesh, axis: str) -> list[torch.Tensor]:
    """Ulysses' first all-to-all over `axis` (n ranks): q [b, h, s, d], k/v [b, hkv, s, d] of this rank's
    tokens -> q, k, v of every rank's tokens for this rank's heads, each [n (source rank), b, heads / n, s, d]
    (kv heads replicated to lcm(hkv, n) first where n does not divide them)."""
    n = mesh.size(axis)
    b, h, s, d = q.shape
    check_ulysses(h, k.shape[1], cp=n, hybrid=axis == ULYSSES_AXIS)
    g = ulysses_kv_heads(k.shape[1], n)
    if g > k.shape[1]:  # replicated next to themselves: kv head j -> copies j*r .. j*r + r - 1
        k, v = k.repeat_interleave(g // k.shape[1], dim=1), v.repeat_interleave(g // k.shape[1], dim=1)
    # [n (destination), b, heads for it (q, then k, then v), s, d]: one message per peer
    send = torch.cat([t.view(b, n, t.shape[1] // n, s, d) for t in (q, k, v)], dim=2).transpose(0, 1)
    got = comm.all_to_all(send.contiguous(), mesh, axis)  # [n (source), b, local heads, s, d]
    return got.split([h // n, g // n, g // n], dim=2)


def _ulysses(q, k, v, mesh: Mesh, axis: str, documents=None) -> torch.Tensor:
    """q [b, h, s, d], k/v [b, hkv, s, d] (this rank's tokens) -> [b, s, h * d], attention over the whole
    sequence by head groups (two all-to-alls over `axis`); `documents`: the whole sequences' (or None)."""
    cp = mesh.size(axis)
    b, h, s, d = q.shape
    # In token order, each of q, k, v a tensor of its own: attention keeps exactly what it would without cp.
    ql, kl, vl = (_to_sequence_order(part, cp, dim=2) for part in _heads_exchange(q, k, v, mesh, axis))
    out = _causal_core(ql, kl, vl, documents).view(b, cp * 2, s // 2, h // cp, d)  # [b, chunk, c, local heads, d]
    # back: every rank its own two chunks, of every head group
    back = torch.stack([torch.cat([out[:, j] for j in chunk_ids(r, cp)], dim=1) for r in range(cp)])
    got = comm.all_to_all(back, mesh, axis)  # [cp (head group), b, s, h / cp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, h * d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, *,
                      axis: str = AXIS, documents: torch.Tensor | None = None) -> torch.Tensor:
    """`ring_attention`'s result by Ulysses' head split: one all-to-all to the whole sequence of heads / cp,
    dense causal attention, one all-to-all back (and the inverse exchanges backward).

    q [b, heads, s, d]; k, v [b, kv_heads, s, d] -- this rank's two chunks. heads must divide by the
    size of `axis` (`check_ulysses`). `documents` as `ring_attention`'s. Returns [b, heads, s, d]. Collective
    over `axis`."""
    b, h, s, d = q.shape
    return _ulysses(q, k, v, mesh, axis, documents).view(b, s, h, d).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# The hybrid (USP): Ulysses inside groups of U consecutive cp ranks, the ring across the groups
# --------------------------------------------------------------------------------------------


def hybrid_mesh(mesh: Mesh, ulysses: int) -> Mesh:
    """`mesh` plus the axes "cp_ulysses" (this rank's group of `ulysses` consecutive cp ranks) and "cp_ring"
    (the ranks at its place in every group); same CommStats. Collective over the world (every rank creates
    every group, in the same order)."""
    def members_of(rank: int, axis: str) -> list[int]:
        cp_ranks = group_ranks(mesh.dims, rank, AXIS)
        i = cp_ranks.index(rank)
        first = i - i % ulysses
        return cp_ranks[first:first + ulysses] if axis == ULYSSES_AXIS else cp_ranks[i % ulysses::ulysses]

    axes, every = {}, {}
    for axis in (ULYSSES_AXIS, RING_AXIS):
        every[axis] = every_group(mesh.world_size, functools.partial(members_of, axis=axis))
        mine, group = members_of(mesh.rank, axis), None
        if len(mine) > 1 and mesh.device_mesh is not None:  # the same size on every rank: all agree
            group = create_groups(every[axis], mesh.rank)
        axes[axis] = (mine, group)
    return mesh.with_axes(axes, every=every)


def _hybrid_chunks(ring_rank: int, *, ulysses: int, cp: int) -> tuple[int, ...]:
    """The chunks (of 2 cp) a group of the ring holds after its all-to-all: its ranks' pairs, in rank order."""
    return tuple(j for u in range(ulysses) for j in chunk_ids(ring_rank * ulysses + u, cp))


def _hybrid(q, k, v, mesh: Mesh, documents=None) -> torch.Tensor:
    """q [b, h, s, d], k/v [b, hkv, s, d] (this rank's tokens) -> [b, s, h * d]: an all-to-all over
    "cp_ulysses" to the group's tokens of heads / U, ring attention over "cp_ring", an all-to-all back."""
    U, cp = mesh.size(ULYSSES_AXIS), mesh.size(AXIS)
    b, h, s, d = q.shape
    # the group's tokens in its ranks' order (the ring masks by chunk index, `_hybrid_chunks`)
    ql, kl, vl = (torch.cat(part.unbind(0), dim=2) for part in _heads_exchange(q, k, v, mesh, ULYSSES_AXIS))
    chunks_of = functools.partial(_hybrid_chunks, ulysses=U, cp=cp)
    out = _RingAttention.apply(ql, kl, vl, mesh, RING_AXIS, chunks_of, documents)  # [b, h / U, U s, d]
    back = torch.stack(out.split(s, dim=2))  # [U (destination), b, h / U, s, d]
    got = comm.all_to_all(back, mesh, ULYSSES_AXIS)  # [U (head group), b, h / U, s, d]
    return got.permute(1, 3, 0, 2, 4).reshape(b, s, h * d)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: Mesh, *,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """`ring_attention`'s result by the hybrid; `mesh` from `hybrid_mesh`. Shapes as `ulysses_attention`."""
    b, h, s, d = q.shape
    return _hybrid(q, k, v, mesh, documents).view(b, s, h, d).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# The transform
# --------------------------------------------------------------------------------------------


def _context_core(q_bhsd, k_bhsd, v_bhsd, documents=None, *, mesh: Mesh, method: str):
    """Replacement of `Attention.core`: [b, h, s, d] in, [b, s, h * d] out (s = this rank's tokens);
    `documents`: the whole sequences' document ids (block-causal), or None."""
    if method == "ulysses":
        return _ulysses(q_bhsd, k_bhsd, v_bhsd, mesh, AXIS, documents)
    if method == "hybrid":
        return _hybrid(q_bhsd, k_bhsd, v_bhsd, mesh, documents)
    attend = ring_attention if method == "ring" else allgather_attention
    out = attend(q_bhsd, k_bhsd, v_bhsd, mesh, documents=documents)
    bsz, _, seq, _ = q_bhsd.shape
    return out.transpose(1, 2).reshape(bsz, seq, -1)


@dataclass
class ContextParallel:
    """What `apply_context_parallel` hands the trainer: how to cut a batch and which positions it has."""

    mesh: Mesh
    method: str

    @property
    def cp(self) -> int:
        return self.mesh.size(AXIS)

    @property
    def cp_rank(self) -> int:
        return self.mesh.local_rank(AXIS)

    def shard(self, x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a batch of sequences (tokens or targets) along `dim`."""
        return shard_sequence(x, cp=self.cp, cp_rank=self.cp_rank, dim=dim)

    def positions(self, seq_len: int, *, device=None) -> torch.Tensor:
        """The true positions of this rank's tokens of a sequence of `seq_len`."""
        return local_positions(seq_len, cp=self.cp, cp_rank=self.cp_rank, device=device)


def apply_context_parallel(model: nn.Module, mesh: Mesh, *, method: str = "ring", ulysses: int = 1) -> ContextParallel:
    """Make every attention of `model` attend across the "cp" ranks (in place); returns the handle.

    `ulysses` > 1 (parallel.cp_ulysses, with method "ring"): the hybrid, Ulysses within groups of that many
    consecutive cp ranks and the ring across the groups (collective: creates the groups, `hybrid_mesh`).
    The model then expects this rank's chunks of every sequence and their true positions
    (`model(handle.shard(tokens), positions=handle.positions(seq_len))`, and with document masking the whole
    sequences' `documents=`, not split); the KV-cache paths used for
    generation are untouched (they do not call `core`)."""
    from meshlm.models.transformer import Attention  # models never import parallel; the reverse is fine

    if method not in METHODS:
        raise ValueError(f"parallel.cp_method={method!r} must be one of {list(METHODS)}")
    check_hybrid(mesh.size(AXIS), ulysses, method)
    core = functools.partial(_context_core, mesh=mesh, method=method)
    if ulysses > 1:
        core = functools.partial(_context_core, mesh=hybrid_mesh(mesh, ulysses), method="hybrid")
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = core
    return ContextParallel(mesh=mesh, method=method)
