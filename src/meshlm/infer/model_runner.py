"""Runs one engine step on the model: a paged KV cache per layer and attention over block tables.

Responsible for: sizing the paged KV cache (per layer a value tensor [kv_heads, num_blocks, block_size,
head_dim] and a key tensor with each block transposed, [kv_heads, num_blocks, head_dim, block_size]:
`new_kv_cache`) from a memory budget or a block count; turning a scheduler step into a plain
`StepInput` (flat token ids, positions, slot mapping, block tables) -- plain data, which rank 0 sends
to its tensor-parallel ranks each step (`infer/parallel.py`); and running the
reference model's own modules with a `PagedAttention` context that the model's `Attention` calls
(`cache.attend(layer, q, k, v)`): it writes the step's keys/values into their slots and attends each
sequence over the keys its block table points to. Decodes are batched in a few buckets of similar length
(`length_buckets`) and attend straight over the cache (`DecodeBatch`: two `embedding_bag` sums, no block
copied); a prefill chunk attends its own keys with fused SDPA, or, after a cached prefix, its blocks copied
into persistent buffers (`GatherBuffers`). Plain PyTorch, runs on CPU; a fused GPU kernel can
replace `PagedAttention.attend` behind the same interface. MoE layers run dropless (the capacity rule of
training, if the model has one, is turned off).
Not responsible for: the model's math other than attention with the paged cache, scheduling, or
sampling (sampling.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshlm.infer.scheduler import SchedulerOutput
from meshlm.models.moe import MoE
from meshlm.models.transformer import Transformer, rope_cos_sin


@dataclass
class StepInput:
    """Everything a rank needs to run one step, as plain Python data (no tensors, no sequences)."""

    token_ids: list[int]  # all sequences' new tokens, concatenated
    positions: list[int]
    slot_mapping: list[int]  # where each new token's k/v goes: block * block_size + offset
    query_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # tokens per sequence after this step (cached + new)
    block_tables: list[list[int]]
    logits_indices: list[int]  # flat rows whose logits are wanted (each sampling sequence's last token)

    @classmethod
    def from_schedule(cls, out: SchedulerOutput, block_size: int) -> "StepInput":
        step = cls([], [], [], [], [], [], [])
        for item in out.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            table = seq.block_table
            for pos in range(start, end):
                step.token_ids.append(seq.token_at(pos))
                step.positions.append(pos)
                step.slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
            step.query_lens.append(item.num_new_tokens)
            step.context_lens.append(end)
            step.block_tables.append(list(table))
            if item.samples:
                step.logits_indices.append(len(step.token_ids) - 1)
        return step


def block_rows(blocks: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The rows of a layer's cache seen as [kv_heads * num_blocks, block_size, head_dim] that hold `blocks`
    (any shape, read in order), for kv head 0, then head 1, ...: what `GatherBuffers.gather` copies."""
    heads = torch.arange(num_kv_heads, device=blocks.device)[:, None] * num_blocks
    return (heads + blocks.reshape(1, -1)).reshape(-1)


class GatherBuffers:
    """Two persistent buffers that the blocks a step attends to are copied into, one layer at a time.

    `index_select` into a buffer that already exists is the fastest copy torch has for this on CPU:
    advanced indexing (`cache[blocks]`) is ~3x slower, and a fresh output each layer adds the page
    faults of a new allocation (~another 3x on the benchmark's shapes)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor):
        """(keys, values) of the cache `rows` (from `block_rows`) as [kv_heads, tokens, head_dim], each
        head's tokens one after the other, as attention reads them. The values are a view of a buffer (valid
        until the next gather); the keys, stored transposed in their blocks, are a copy in token order."""
        num_kv, num_blocks, dim, block_size = k_cache.shape
        n = rows.numel()
        if self.k is None or self.k.shape[0] < n or self.k.dtype != k_cache.dtype or self.k.device != k_cache.device:
            shape = (max(n, 2 * (self.k.shape[0] if self.k is not None else 0)), block_size, dim)
            self.k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            self.v = torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device)
        kt = torch.index_select(k_cache.view(num_kv * num_blocks, dim, block_size), 0, rows,
                                out=self.k[:n].view(n, dim, block_size))
        v = torch.index_select(v_cache.view(num_kv * num_blocks, block_size, dim), 0, rows, out=self.v[:n])
        k = kt.view(num_kv, -1, dim, block_size).transpose(-1, -2).reshape(num_kv, -1, dim)
        return k, v.view(num_kv, -1, dim)


def new_kv_cache(num_kv: int, num_blocks: int, block_size: int, head_dim: int, *, dtype: torch.dtype,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed (keys, values): values [kv_heads, num_blocks, block_size, head_dim]; keys transposed
    in their block, [kv_heads, num_blocks, head_dim, block_size] (what `DecodeBatch` reads). kv heads lead: a
    head's blocks are one tensor, so the blocks a step reads are rows of one table."""
    return (torch.zeros(num_kv, num_blocks, head_dim, block_size, dtype=dtype, device=device),
            torch.zeros(num_kv, num_blocks, block_size, head_dim, dtype=dtype, device=device))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_hsd: torch.Tensor,
             v_hsd: torch.Tensor) -> None:
    """Store new keys/values [kv_heads, tokens, head_dim] at `slots` (block * block_size + offset); keys go
    transposed into their block ([kv_heads, blocks, head_dim, block_size], see `ModelRunner`)."""
    num_kv, _, _, dim = v_cache.shape
    block_size = v_cache.shape[2]
    k_cache[:, slots // block_size, :, slots % block_size] = k_hsd.transpose(0, 1).to(k_cache.dtype)
    v_cache.view(num_kv, -1, dim)[:, slots] = v_hsd.to(v_cache.dtype)


class DecodeBatch:
    """Attention of a batch of decodes (one new token each) straight over the paged cache, no block copied.

    Two `embedding_bag` sums -- an indexed, weighted sum of table rows computed where the rows lie:
      * scores: a key block is stored transposed ([head_dim, block_size]), so the scores of one query
        against one block are the block's head_dim rows weighted by the query's head_dim entries (one bag
        of head_dim rows per query head and block);
      * output: the value rows of a sequence's keys weighted by their softmax weights (one bag per query
        head, a row per key).
    Copying the blocks out first (index_select into a buffer, then two batched matmuls) moves every key
    and value three times; this reads each once (2-4x faster on the benchmark's shapes, CPU). The batch is
    padded to its longest sequence (block 0 stands in for missing blocks) and masked."""

    def __init__(self, rows: torch.Tensor, blocks: torch.Tensor, keep: torch.Tensor, *, num_kv: int,
                 num_blocks: int, dtype: torch.dtype):
        """`rows`: whatever the caller indexes its queries by; `blocks` [batch, width]: the cache blocks each
        decode attends (padding: any block); `keep` [batch, width * block_size]: which of their keys it sees."""
        self.rows = rows
        device = blocks.device
        self.heads = torch.arange(num_kv, device=device)[:, None, None] * num_blocks + blocks[None]  # [kv, batch, width]
        self.mask = _additive(keep[:, None], dtype)  # broadcast over [kv, batch, groups, keys]
        self.k_index = self.v_index = None  # built by the first layer, which knows the query heads per kv head

    @classmethod
    def of_sequences(cls, rows: torch.Tensor, tables: list[list[int]], lengths: list[int], *, block_size: int,
                     **kwargs) -> "DecodeBatch":
        """Decodes of whole sequences: each attends the first `length` keys of its block table."""
        width = max(len(t) for t in tables)
        blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        keep = torch.arange(width * block_size)[None, :] < torch.tensor(lengths)[:, None]
        return cls(rows, blocks.to(rows.device), keep.to(rows.device), **kwargs)

    def _index(self, groups: int, dim: int, block_size: int) -> None:
        num_kv, batch, width = self.heads.shape
        device = self.heads.device
        # keys: row (head * num_blocks + block) * dim + d of the [.., block_size] table, per query head
        k_rows = (self.heads * dim)[..., None] + torch.arange(dim, device=device)  # [kv, batch, width, dim]
        self.k_index = k_rows[:, :, None].expand(num_kv, batch, groups, width, dim).reshape(-1, dim)
        # values: row (head * num_blocks + block) * block_size + offset of the [.., dim] table
        v_rows = ((self.heads * block_size)[..., None] + torch.arange(block_size, device=device))
        self.v_index = v_rows.reshape(num_kv, batch, 1, -1).expand(num_kv, batch, groups, width * block_size).reshape(
            -1, width * block_size)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, with_lse: bool = False):
        """q [kv_heads, batch, groups, dim] -> output [kv_heads, batch, groups, dim] (in q's dtype), and with
        `with_lse` the log-sum-exp of the scores [kv_heads, batch, groups] (-inf, output 0, where no key is
        seen): the partial that context-parallel serving merges over ranks."""
        num_kv, batch, groups, dim = q.shape
        block_size, dtype = k_cache.shape[-1], q.dtype
        width = self.heads.shape[-1]
        if self.k_index is None:
            self._index(groups, dim, block_size)
        q = q.to(k_cache.dtype) * dim ** -0.5  # the softmax scale on the queries (fewer than the scores)
        weights = q[:, :, :, None, :].expand(num_kv, batch, groups, width, dim).reshape(-1, dim)
        scores = F.embedding_bag(self.k_index, k_cache.view(-1, block_size), mode="sum", per_sample_weights=weights)
        scores = scores.view(num_kv, batch, groups, -1).to(torch.promote_types(q.dtype, torch.float32))
        scores = scores.add_(self.mask)
        if with_lse:
            lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)
        else:
            probs = torch.softmax(scores, dim=-1)
        out = F.embedding_bag(self.v_index, v_cache.view(-1, v_cache.shape[-1]), mode="sum",
                              per_sample_weights=probs.view(-1, probs.shape[-1]).to(v_cache.dtype))
        out = out.view(num_kv, batch, groups, dim).to(dtype)
        return (out, lse) if with_lse else out


def read_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """The keys and values at `slots` (block * block_size + offset) as [kv_heads, len(slots), head_dim] copies."""
    num_kv, _, block_size, dim = v_cache.shape
    k = k_cache[:, slots // block_size, :, slots % block_size]  # [slots, kv_heads, dim]
    return k.transpose(0, 1), v_cache.view(num_kv, -1, dim)[:, slots]


def length_buckets(lengths: list[int], *, min_size: int = 16, max_buckets: int = 4) -> list[list[int]]:
    """Indices of `lengths` in a few groups of similar length (shortest first), each at least `min_size`
    long (but one): a batch padded to its longest sequence wastes ~half its keys when lengths are spread
    evenly, four groups ~an eighth, and every group costs a few more kernel launches per layer."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    count = max(1, min(max_buckets, len(order) // min_size))
    return [order[i * len(order) // count:(i + 1) * len(order) // count] for i in range(count)]


class PagedAttention:
    """The per-step attention context handed to the model as its `cache`."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], step: StepInput, block_size: int,
                 *, dtype: torch.dtype, buffers: GatherBuffers | None = None):
        device = k_caches[0].device
        num_kv, num_blocks = k_caches[0].shape[:2]
        self.k_caches, self.v_caches = k_caches, v_caches
        self.buffers = buffers or GatherBuffers()
        self.seconds = 0.0  # spent in attend (the runner adds it up: the benchmark's attention share)
        self.slots = torch.tensor(step.slot_mapping, dtype=torch.long, device=device)

        def rows_of(tables: list[list[int]], num: int) -> torch.Tensor:
            """Cache rows of the first `num` blocks of each table (missing ones: block 0, masked)."""
            blocks = torch.tensor([t[:num] + [0] * (num - len(t[:num])) for t in tables], dtype=torch.long)
            return block_rows(blocks, num_kv, num_blocks).to(device)

        # Keys/values are gathered a whole block at a time (one index per block and head, not per token).
        # Decodes (one new token) are batched in a few buckets of similar length, each padded to its
        # longest context and masked; prefill chunks run one sequence at a time with their own causal mask.
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(step.query_lens) if n == 1]
        self.decode = []  # DecodeBatch per bucket
        for bucket in length_buckets([step.context_lens[i] for i in decode]) if decode else []:
            seqs = [decode[j] for j in bucket]
            longest = -(-max(step.context_lens[i] for i in seqs) // block_size)
            self.decode.append(DecodeBatch.of_sequences(
                torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device),
                [step.block_tables[i][:longest] for i in seqs], [step.context_lens[i] for i in seqs],
                block_size=block_size, num_kv=num_kv, num_blocks=num_blocks, dtype=dtype))
        # (first row, new tokens, context length, cache rows, additive causal mask: None for a chunk with
        # nothing cached before it)
        self.prefills = []
        for i, n in enumerate(step.query_lens):
            if n == 1:
                continue
            length = step.context_lens[i]
            # Query j sits at position (length - n) + j and sees the keys up to it.
            mask = None if n == length else _additive(
                torch.ones(n, length, dtype=torch.bool, device=device).tril(diagonal=length - n), dtype)
            self.prefills.append((starts[i], n, length, rows_of([step.block_tables[i]], -(-length // block_size)),
                                  mask))

    def attend(self, layer: int, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self._attend(layer, q_bhsd, k_bhsd, v_bhsd)
        self.seconds += time.perf_counter() - start
        return out

    def _attend(self, layer: int, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor) -> torch.Tensor:
        assert q_bhsd.shape[0] == 1, "the engine packs all sequences of a step into one row"
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]  # see ModelRunner
        write_kv(k_cache, v_cache, self.slots, k_bhsd[0], v_bhsd[0])
        num_kv, dim = k_bhsd.shape[1], q_bhsd.shape[-1]
        groups = q_bhsd.shape[1] // num_kv
        out = torch.empty_like(q_bhsd)
        # Grouped-query attention without copying k/v per query head: the `groups` query heads that
        # share a kv head are one more dim of q, k/v broadcast over it (prefill) or indexed per group (decode).
        for batch in self.decode:
            rows = batch.rows
            q = q_bhsd[0, :, rows].view(num_kv, groups, rows.numel(), dim).transpose(1, 2)  # [kv, batch, groups, dim]
            o = batch.attend(q, k_cache, v_cache)
            out[0, :, rows] = o.transpose(1, 2).reshape(num_kv * groups, rows.numel(), dim)
        for start, n, length, cache_rows, mask in self.prefills:
            q = q_bhsd[0, :, start:start + n].reshape(num_kv, groups, n, dim)
            if mask is None and k_cache.dtype == k_bhsd.dtype:  # nothing cached before: the step's own keys
                k, v = k_bhsd[0, :, start:start + n], v_bhsd[0, :, start:start + n]
            else:
                k, v = self.buffers.gather(k_cache, v_cache, cache_rows)
            # [kv_heads, groups, len, dim], a broadcast view: with equal head counts SDPA takes its fused
            # CPU kernel (~2x its plain one).
            k = k[:, None, :length].to(q.dtype).expand(num_kv, groups, length, dim)
            v = v[:, None, :length].to(q.dtype).expand(num_kv, groups, length, dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            out[0, :, start:start + n] = o.reshape(num_kv * groups, n, dim)
        return out


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean keep-mask as 0 / -inf, built once per step rather than converted in every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def local_kv_heads(model: Transformer) -> int:
    """The kv heads this rank's model computes: all of them, or its share under tensor parallelism (read
    from the key projection's width, as the model's attention does)."""
    attn = next(iter(model.layers.values())).attn
    return attn.wk.out_features // model.config.head_dim


def kv_block_bytes(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block on this rank: keys and values of `block_size` tokens, every layer, local heads."""
    cfg = model.config
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * local_kv_heads(model) * cfg.head_dim * itemsize


class ModelRunner:
    def __init__(self, model: Transformer, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, kv_dtype: torch.dtype | None = None, attention=None):
        """KV cache of `num_blocks` blocks, or as many as fit in `kv_cache_memory_bytes` (default 256 MiB, per
        rank: under tensor parallelism a block holds only this rank's kv heads, so the same budget holds tp
        times the blocks). `attention`: the class of the per-step attention context (default
        `PagedAttention`; context-parallel serving passes one that attends over this rank's blocks)."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1 (tokens per KV block; 16 is usual)")
        self.model = model.eval()
        for module in model.modules():
            if isinstance(module, MoE):
                # Inference is dropless whatever the training's capacity rule: with a cap, a token's experts
                # (and so its output) would depend on what else is in its batch -- continuous batching and
                # chunked prefill change that every step, and under tensor parallelism every rank routes
                # only its share of the tokens. Hugging Face MoEs are dropless too.
                module.capacity_factor = 0.0
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.block_size = block_size
        cfg = model.config
        if num_blocks is None:
            budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else 256 << 20
            num_blocks = budget // kv_block_bytes(model, block_size, self.kv_dtype)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of "
                                 f"{kv_block_bytes(model, block_size, self.kv_dtype)} bytes; give it more memory")
        self.num_blocks = num_blocks
        caches = [new_kv_cache(local_kv_heads(model), num_blocks, block_size, cfg.head_dim, dtype=self.kv_dtype,
                               device=self.device) for _ in range(cfg.num_layers)]
        self.k_caches, self.v_caches = [k for k, _ in caches], [v for _, v in caches]
        self.buffers = GatherBuffers()  # reused by every layer of every step
        self.attention = attention or PagedAttention
        self.attention_seconds = 0.0  # PagedAttention's time, summed over steps (not under other `attention`)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run the step's tokens; return float32 logits [len(step.logits_indices), vocab] (under tensor
        parallelism this rank's vocab slice: the lm_head is split over the vocabulary)."""
        model = self.model
        tokens = torch.tensor(step.token_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        ctx = self.attention(self.k_caches, self.v_caches, step, self.block_size, dtype=self.dtype,
                             buffers=self.buffers)
        # The model's own modules; only attention is redirected to the paged cache (via `ctx`). Logits
        # are computed for the sampling rows only, not for every prefill token. An attention context with
        # `local_rows` (context-parallel serving) has this rank compute only those of the step's tokens.
        local = getattr(ctx, "local_rows", None)
        if local is not None:
            tokens, positions = tokens[local], positions[local]
        h = model.embed(tokens[None])
        cos, sin = rope_cos_sin(model.inv_freq, positions, h.dtype)
        for block in model.layers.values():
            h = block(h, cos, sin, ctx)
        if local is not None:
            h = ctx.select_rows(h)
        else:
            h = h[0, torch.tensor(step.logits_indices, dtype=torch.long, device=self.device)]
        self.attention_seconds += getattr(ctx, "seconds", 0.0)
        return model.lm_head(model.norm(h)).float()
