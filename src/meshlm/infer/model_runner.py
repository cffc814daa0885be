"""Runs one engine step on the model: a paged KV cache per layer and attention over block tables.

Responsible for: sizing the paged KV cache (one [kv_heads, num_blocks, block_size, head_dim] key and
value tensor per layer) from a memory budget or a block count; turning a scheduler step into a plain
`StepInput` (flat token ids, positions, slot mapping, block tables) -- plain data, which rank 0 sends
to its tensor-parallel ranks each step (`infer/parallel.py`); and running the
reference model's own modules with a `PagedAttention` context that the model's `Attention` calls
(`cache.attend(layer, q, k, v)`): it writes the step's keys/values into their slots and attends each
sequence over the keys its block table points to -- the blocks copied into persistent buffers a layer at
a time, decodes batched in a few buckets of similar length (`length_buckets`), each prefill chunk on its
own. Plain PyTorch, runs on CPU; a fused GPU kernel can
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
        """(keys, values) of the cache `rows` (from `block_rows`) as [kv_heads, tokens, head_dim] views of the
        buffers (valid until the next gather): each head's keys one after the other, as attention reads them."""
        num_kv, num_blocks, block_size, dim = k_cache.shape
        n = rows.numel()
        if self.k is None or self.k.shape[0] < n or self.k.dtype != k_cache.dtype or self.k.device != k_cache.device:
            shape = (max(n, 2 * (self.k.shape[0] if self.k is not None else 0)), block_size, dim)
            self.k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            self.v = torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device)
        k = torch.index_select(k_cache.view(num_kv * num_blocks, block_size, dim), 0, rows, out=self.k[:n])
        v = torch.index_select(v_cache.view(num_kv * num_blocks, block_size, dim), 0, rows, out=self.v[:n])
        return k.view(num_kv, -1, dim), v.view(num_kv, -1, dim)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_hsd: torch.Tensor,
             v_hsd: torch.Tensor) -> None:
    """Store new keys/values [kv_heads, tokens, head_dim] at `slots` (block * block_size + offset)."""
    num_kv, _, _, dim = k_cache.shape
    k_cache.view(num_kv, -1, dim)[:, slots] = k_hsd.to(k_cache.dtype)
    v_cache.view(num_kv, -1, dim)[:, slots] = v_hsd.to(v_cache.dtype)


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
        self.decode = []  # (rows of the outputs, cache rows of their blocks, additive mask [batch, 1, keys])
        for bucket in length_buckets([step.context_lens[i] for i in decode]) if decode else []:
            seqs = [decode[j] for j in bucket]
            longest = -(-max(step.context_lens[i] for i in seqs) // block_size)
            lengths = torch.tensor([step.context_lens[i] for i in seqs])
            keep = torch.arange(longest * block_size)[None, :] < lengths[:, None]
            self.decode.append((torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device),
                                rows_of([step.block_tables[i] for i in seqs], longest),
                                _additive(keep[:, None].to(device), dtype)))
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
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]  # [kv_heads, blocks, block_size, dim]
        write_kv(k_cache, v_cache, self.slots, k_bhsd[0], v_bhsd[0])
        num_kv, dim = k_bhsd.shape[1], q_bhsd.shape[-1]
        groups = q_bhsd.shape[1] // num_kv
        out = torch.empty_like(q_bhsd)
        # Grouped-query attention without copying k/v per query head: the `groups` query heads that
        # share a kv head are one more dim of q (decode: extra query rows), k/v broadcast over it. The
        # kv heads lead (the cache's layout), so the gathered keys need no transpose.
        for rows, cache_rows, mask in self.decode:
            batch = rows.numel()
            q = q_bhsd[0, :, rows].view(num_kv, groups, batch, dim).transpose(1, 2)  # [kv, batch, groups, dim]
            k, v = self.buffers.gather(k_cache, v_cache, cache_rows)
            k = k.view(num_kv, batch, -1, dim).to(q.dtype)  # [kv, batch, keys, dim]
            v = v.view(num_kv, batch, -1, dim).to(q.dtype)
            # Two batched matmuls and a softmax: SDPA's CPU kernels are no faster on one query row per
            # sequence, and they check the mask for rows with no key on every call.
            scores = torch.matmul(q, k.transpose(-1, -2)).mul_(dim ** -0.5).add_(mask)
            weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
            o = torch.matmul(weights.to(v.dtype), v)
            out[0, :, rows] = o.transpose(1, 2).reshape(num_kv * groups, batch, dim)
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
        # kv heads first: a head's blocks are one [num_blocks, block_size, head_dim] tensor, so the blocks a
        # step gathers come out as the [kv_heads, keys, head_dim] that attention multiplies, with no transpose.
        shape = (local_kv_heads(model), num_blocks, block_size, cfg.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(cfg.num_layers)]
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
