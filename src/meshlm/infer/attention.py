"""The paged KV cache's layout and attention over it: what the model's `Attention` calls each step.

Responsible for: the layout of one layer's cache (`new_kv_cache`: values [kv_heads, num_blocks, block_size,
head_dim], keys with each block transposed, [kv_heads, num_blocks, head_dim, block_size]), writing a step's
keys/values into their slots and reading slots back (`write_kv`, `read_slots`); and `PagedAttention`, the
per-step context handed to the model as its `cache` (`cache.attend(layer, q, k, v)`): it writes the step's
keys/values and attends each sequence over the keys its block table points to. All decodes of a step are one
batch that attends straight over the cache (`DecodeBatch`: two `embedding_bag` sums, no block copied, no key
padded; context-parallel serving reuses it for its split-KV partials); a prefill chunk attends its own keys
with fused SDPA, or, after a cached prefix, its blocks copied into persistent buffers (`GatherBuffers`).
Plain PyTorch, runs on CPU; a fused GPU kernel can replace `PagedAttention.attend` behind the same interface,
and on a CPU with an fp32 cache decodes run the compiled kernel of `infer/native.py`.
Not responsible for: sizing the cache or running the model (model_runner.py), or attention across
context-parallel ranks (parallel.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from meshlm.host_memory import advise_huge_pages
from meshlm.infer.native import decode_attention_kernel, native_decode_attention

if TYPE_CHECKING:  # model_runner.py imports this module: the step's type only for annotations
    from meshlm.infer.model_runner import StepInput


def new_kv_cache(num_kv: int, num_blocks: int, block_size: int, head_dim: int, *, dtype: torch.dtype,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed (keys, values): values [kv_heads, num_blocks, block_size, head_dim]; keys transposed
    in their block, [kv_heads, num_blocks, head_dim, block_size] (what `DecodeBatch` reads). kv heads lead: a
    head's blocks are one tensor, so the blocks a step reads are rows of one table. On a CPU, on huge pages
    where Linux gives them (`advise_huge_pages`, before the zeros touch the memory)."""
    caches = (torch.empty(num_kv, num_blocks, head_dim, block_size, dtype=dtype, device=device),
              torch.empty(num_kv, num_blocks, block_size, head_dim, dtype=dtype, device=device))
    for c in caches:
        advise_huge_pages(c)
        c.zero_()
    return caches


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_hsd: torch.Tensor,
             v_hsd: torch.Tensor) -> None:
    """Store new keys/values [kv_heads, tokens, head_dim] at `slots` (block * block_size + offset); keys go
    transposed into their block ([kv_heads, blocks, head_dim, block_size], see `new_kv_cache`)."""
    num_kv, _, block_size, dim = v_cache.shape
    # index_copy_ into flat views (advanced-index assignment takes a path several times slower on CPU)
    k_pos = ((slots // block_size) * (dim * block_size) + slots % block_size)[:, None] \
        + torch.arange(dim, device=slots.device) * block_size  # [tokens, dim] in the flat key table
    k_cache.view(num_kv, -1).index_copy_(1, k_pos.reshape(-1), k_hsd.to(k_cache.dtype).reshape(num_kv, -1))
    v_cache.view(num_kv, -1, dim).index_copy_(1, slots, v_hsd.to(v_cache.dtype))


def read_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """The keys and values at `slots` (block * block_size + offset) as [kv_heads, len(slots), head_dim] copies."""
    num_kv, _, block_size, dim = v_cache.shape
    k = k_cache[:, slots // block_size, :, slots % block_size]  # [slots, kv_heads, dim]
    return k.transpose(0, 1), v_cache.view(num_kv, -1, dim)[:, slots]


class PagedAttention:
    """The per-step attention context handed to the model as its `cache`."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], step: StepInput, block_size: int,
                 *, dtype: torch.dtype, buffers: GatherBuffers | None = None, native: bool = True):
        device = k_caches[0].device
        num_kv, num_blocks = k_caches[0].shape[:2]
        self.k_caches, self.v_caches = k_caches, v_caches
        self.buffers = buffers or GatherBuffers()
        self.seconds = 0.0  # spent in attend (the runner adds it up: the benchmark's attention share)
        self.slots = torch.tensor(step.slot_mapping, dtype=torch.long, device=device)

        def rows_of(tables: list[list[int]], num: int) -> torch.Tensor:
            """Cache rows of the first `num` blocks of each table (missing ones: block 0, masked)."""
            blocks = padded([t[:num] for t in tables], num, torch.long)
            return block_rows(blocks, num_kv, num_blocks).to(device)

        # Decodes (one new token) are one batch that attends straight over the cache (`DecodeBatch`);
        # prefill chunks run one sequence at a time with their own causal mask, their blocks gathered a
        # whole block at a time (one index per block and head, not per token) when something is cached.
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        # A sequence verifying k proposals is k + 1 decodes, each over the keys up to its position.
        rows, decode, lengths = step.decode_rows()
        self.decode = DecodeBatch.of_sequences(
            torch.tensor(rows, dtype=torch.long, device=device), [step.block_tables[i] for i in decode], lengths,
            block_size=block_size, num_kv=num_kv, num_blocks=num_blocks, dtype=dtype, native=native) if rows else None
        # (first row, new tokens, context length, cache rows, additive causal mask: None for a chunk with
        # nothing cached before it)
        self.prefills = []
        decoding = set(decode)
        for i, n in enumerate(step.query_lens):
            if i in decoding:
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
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]  # see new_kv_cache
        write_kv(k_cache, v_cache, self.slots, k_bhsd[0], v_bhsd[0])
        num_kv, dim = k_bhsd.shape[1], q_bhsd.shape[-1]
        groups = q_bhsd.shape[1] // num_kv
        out = torch.empty_like(q_bhsd)
        # Grouped-query attention without copying k/v per query head: the `groups` query heads that
        # share a kv head are one more dim of q, k/v broadcast over it (prefill) or indexed per group (decode).
        if self.decode is not None:
            rows = self.decode.rows
            q = torch.index_select(q_bhsd[0], 1, rows).view(num_kv, groups, rows.numel(), dim).transpose(1, 2)
            o = self.decode.attend(q, k_cache, v_cache)  # [kv, batch, groups, dim]
            out[0].index_copy_(1, rows, o.transpose(1, 2).reshape(num_kv * groups, rows.numel(), dim))
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


def block_rows(blocks: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The rows of a layer's cache seen as [kv_heads * num_blocks, block_size, head_dim] that hold `blocks`
    (any shape, read in order), for kv head 0, then head 1, ...: what `GatherBuffers.gather` copies."""
    heads = torch.arange(num_kv_heads, device=blocks.device)[:, None] * num_blocks
    return (heads + blocks.reshape(1, -1)).reshape(-1)


class GatherBuffers:
    """Two persistent buffers that the blocks a step attends to are copied into, one layer at a time.

    `index_select` into a buffer that already exists is the fastest copy torch has for this on CPU:
    advanced indexing (`cache[blocks]`) takes a slower path, and a fresh output each layer adds the page
    faults of a new allocation (README.md, the paged KV cache paragraph, has the measured ratios)."""

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


def padded(rows: list[list[int]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Lists of at most `width` ints as one [len(rows), width] tensor, each filled out with 0 (block 0, or
    no key: whoever reads it masks the filling)."""
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype)


class DecodeBatch:
    """Attention of a batch of decodes (one new token each) straight over the paged cache, no block copied,
    no key padded.

    Two `embedding_bag` sums -- an indexed, weighted sum of table rows computed where the rows lie:
      * scores: a key block is stored transposed ([head_dim, block_size]), so the scores of one query
        against one block are the block's head_dim rows weighted by the query's head_dim entries (one bag
        of head_dim rows per query head and block);
      * output: the value rows of a sequence's visible keys weighted by their softmax weights (one bag per
        query head, of exactly that sequence's keys: bags of any length, `offsets`).
    Copying the blocks out first (index_select into a buffer, then two batched matmuls) moves every key
    and value three times; this reads each once (README.md has the measured gain). All decodes
    of a step are one batch whatever their lengths: only the scores (a few floats per key) are laid out
    padded to the longest sequence for the softmax, never the keys or values. The indices are built once
    per step (by the first layer) and serve every layer.

    With `native` (the default), an fp32 cache on a CPU is attended by the compiled kernel of `infer/native.py`
    instead (the same sums in one pass, no index tensor) whenever it could be built; otherwise, and with
    `native=False`, by the torch ops below."""

    def __init__(self, rows: torch.Tensor, blocks: list[list[int]], counts: list[list[int]], *, block_size: int,
                 num_kv: int, num_blocks: int, dtype: torch.dtype, native: bool = True):
        """`rows`: whatever the caller indexes its queries by; `blocks[i]`: the cache blocks decode i attends;
        `counts[i][j]`: how many keys of block `blocks[i][j]` it sees (the block's first ones)."""
        self.rows, self.dtype, self.native = rows, dtype, native
        self.block_size, self.num_kv, self.num_blocks = block_size, num_kv, num_blocks
        self.blocks, self.counts = blocks, counts
        self.width = max(map(len, blocks), default=0)  # most blocks of any decode: the scores' padded width
        self.index = None  # built by the first layer, which knows the query heads per kv head
        self.table = None  # (blocks, counts) as int32 [batch, width]: the native kernel's whole index

    @classmethod
    def of_sequences(cls, rows: torch.Tensor, tables: list[list[int]], lengths: list[int], *, block_size: int,
                     **kwargs) -> "DecodeBatch":
        """Decodes of whole sequences: each attends the first `length` keys of its block table."""
        blocks = [t[:-(-n // block_size)] for t, n in zip(tables, lengths)]
        counts = [[block_size] * (len(b) - 1) + [n - (len(b) - 1) * block_size] for b, n in zip(blocks, lengths)]
        return cls(rows, blocks, counts, block_size=block_size, **kwargs)

    def _build(self, groups: int, dim: int) -> "_DecodeIndex":
        """Every index the layers share. Bags are ordered [kv head, decode, query head of the group, block]
        (scores) and [kv head, decode, query head of the group] (values); positions are read off masks over
        the padded layout [decode, group, block(, key of the block)], so no Python loop runs per key. In
        32 bits where the numbers fit: embedding_bag reads fewer index bytes, and the broadcast adds that
        build them move half the memory of 64 bits (README.md has the measured gain on CPU)."""
        bs, batch, width, nb, num_kv = self.block_size, len(self.blocks), self.width, self.num_blocks, self.num_kv
        small = torch.int32 if num_kv * max(nb * max(dim, bs), batch * groups * width * bs) < 2 ** 31 else torch.long
        blocks, counts = padded(self.blocks, width, small), padded(self.counts, width, small)  # [batch, width]
        heads = torch.arange(num_kv, dtype=small)[:, None]
        # score bags: each (decode, group) and each block it attends
        used = torch.nonzero((counts > 0)[:, None].expand(batch, groups, width).reshape(-1)).squeeze(1)

        def per_bag(t: torch.Tensor) -> torch.Tensor:  # [batch, width] -> one value per score bag
            return t[:, None].expand(batch, groups, width).reshape(-1)[used]

        k_index = ((per_bag(blocks) * dim)[:, None] + torch.arange(dim, dtype=small)).expand(num_kv, -1, -1) \
            + (heads * nb * dim)[..., None]
        unseen = torch.arange(bs) >= per_bag(counts)[:, None]
        # value bags: each (decode, group), over the keys it sees
        seen = (torch.arange(bs, dtype=small) < counts[..., None]).view(batch, 1, width * bs)
        seen = seen.expand(batch, groups, width * bs)
        place = torch.nonzero(seen.reshape(-1)).squeeze(1).to(small)  # into the padded scores of one kv head
        slots = (blocks[..., None] * bs + torch.arange(bs, dtype=small)).view(batch, 1, -1).expand(batch, groups, -1)
        sizes = seen.sum(-1, dtype=small).reshape(1, -1).expand(num_kv, -1).reshape(-1)
        device = self.rows.device
        return _DecodeIndex(
            k_index=k_index.reshape(-1, dim).to(device),
            query=(used // width).to(device),
            dest=((heads * batch * groups * width).long() + used).reshape(-1).to(device),
            bag_mask=torch.zeros(unseen.shape, dtype=self.dtype).masked_fill_(unseen, float("-inf")).to(device),
            v_index=(slots.reshape(-1)[place] + heads * nb * bs).reshape(-1).to(device),
            prob_index=(place + heads * batch * groups * width * bs).reshape(-1).to(device),
            offsets=(torch.cumsum(sizes, 0, dtype=small) - sizes).to(device))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, with_lse: bool = False):
        """q [kv_heads, batch, groups, dim] -> output [kv_heads, batch, groups, dim] (in q's dtype), and with
        `with_lse` the log-sum-exp of the scores [kv_heads, batch, groups] (-inf, output 0, where no key is
        seen): the partial that context-parallel serving merges over ranks."""
        num_kv, batch, groups, dim = q.shape
        block_size, dtype = k_cache.shape[-1], q.dtype
        if self.native and self._native_applies(q, k_cache, v_cache):
            if self.table is None:
                self.table = tuple(padded(rows, self.width, torch.int32) for rows in (self.blocks, self.counts))
            return native_decode_attention(q * dim ** -0.5, k_cache, v_cache, *self.table, with_lse=with_lse)
        if self.index is None:
            self.index = self._build(groups, dim)
        ix = self.index
        q = q.to(k_cache.dtype) * dim ** -0.5  # the softmax scale on the queries (fewer than the scores)
        weights = torch.index_select(q.reshape(num_kv, batch * groups, dim), 1, ix.query).reshape(-1, dim)
        bags = F.embedding_bag(ix.k_index, k_cache.view(-1, block_size), mode="sum", per_sample_weights=weights)
        bags = bags.to(torch.promote_types(dtype, torch.float32)).view(num_kv, -1, block_size).add_(ix.bag_mask)
        scores = bags.new_full((num_kv * batch * groups * self.width, block_size), float("-inf"))
        scores.index_copy_(0, ix.dest, bags.view(-1, block_size))
        scores = scores.view(num_kv, batch, groups, -1)
        if with_lse:
            lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)
        else:
            probs = torch.softmax(scores, dim=-1)
        weights = torch.index_select(probs.view(-1), 0, ix.prob_index).to(v_cache.dtype)
        out = F.embedding_bag(ix.v_index, v_cache.view(-1, v_cache.shape[-1]), ix.offsets, mode="sum",
                              per_sample_weights=weights)
        out = out.view(num_kv, batch, groups, dim).to(dtype)
        return (out, lse) if with_lse else out

    @staticmethod
    def _native_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
                and k_cache.is_contiguous() and v_cache.is_contiguous() and decode_attention_kernel() is not None)


@dataclass
class _DecodeIndex:
    k_index: torch.Tensor  # [bags, head_dim] rows of the transposed key table, a bag per (kv, decode, group, block)
    query: torch.Tensor  # the (decode, group) whose query weighs each bag (same for every kv head)
    dest: torch.Tensor  # each bag's row among the padded scores [kv * batch * groups * width, block_size]
    bag_mask: torch.Tensor  # [bags of one kv head, block_size]: -inf on keys past the block's count
    v_index: torch.Tensor  # value rows, a run per (kv, decode, group): that decode's visible keys
    prob_index: torch.Tensor  # where each of those keys' probability lies in the padded scores (flat)
    offsets: torch.Tensor  # where each run starts in v_index
