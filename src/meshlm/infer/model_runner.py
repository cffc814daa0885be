"""Runs one engine step on the model: a paged KV cache per layer and attention over block tables.

Responsible for: sizing the paged KV cache (one [num_blocks, block_size, kv_heads, head_dim] key and
value tensor per layer) from a memory budget or a block count; turning a scheduler step into a plain
`StepInput` (flat token ids, positions, slot mapping, block tables) -- plain data, which rank 0 sends
to its tensor-parallel ranks each step (`infer/parallel.py`); and running the
reference model's own modules with a `PagedAttention` context that the model's `Attention` calls
(`cache.attend(layer, q, k, v)`): it writes the step's keys/values into their slots and attends each
sequence over the keys its block table points to. Plain PyTorch, runs on CPU; a fused GPU kernel can
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


class GatherBuffers:
    """Two persistent buffers that the blocks a step attends to are copied into, one layer at a time.

    `index_select` into a buffer that already exists is the fastest copy torch has for this on CPU:
    advanced indexing (`cache[blocks]`) is ~3x slower, and a fresh output each layer adds the page
    faults of a new allocation (~another 3x on the benchmark's shapes)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor):
        """(keys, values) of `blocks` (any shape of block ids) as [*blocks.shape, block_size, kv_heads, dim]
        views of the buffers (valid until the next gather)."""
        n = blocks.numel()
        if self.k is None or self.k.shape[0] < n or self.k.dtype != k_cache.dtype or self.k.device != k_cache.device:
            shape = (max(n, 2 * (self.k.shape[0] if self.k is not None else 0)), *k_cache.shape[1:])
            self.k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            self.v = torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device)
        index = blocks.reshape(-1)
        k = torch.index_select(k_cache, 0, index, out=self.k[:n])
        v = torch.index_select(v_cache, 0, index, out=self.v[:n])
        return k.view(*blocks.shape, *k_cache.shape[1:]), v.view(*blocks.shape, *v_cache.shape[1:])


class PagedAttention:
    """The per-step attention context handed to the model as its `cache`."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], step: StepInput, block_size: int,
                 *, dtype: torch.dtype, buffers: GatherBuffers | None = None):
        device = k_caches[0].device
        self.k_caches, self.v_caches = k_caches, v_caches
        self.buffers = buffers or GatherBuffers()
        self.seconds = 0.0  # spent in attend (the runner adds it up: the benchmark's attention share)
        self.slots = torch.tensor(step.slot_mapping, dtype=torch.long, device=device)

        def blocks_of(table: list[int], length: int) -> torch.Tensor:
            return torch.tensor(table[:-(-length // block_size)], dtype=torch.long)

        # Keys/values are gathered a whole block at a time (one index per block, not per token).
        # Decodes (one new token) are batched, their blocks padded to the longest context and masked;
        # prefill chunks run one sequence at a time with their own causal mask.
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(step.query_lens) if n == 1]
        self.decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device)
        self.decode_blocks = self.decode_mask = None
        if decode:
            longest = -(-max(step.context_lens[i] for i in decode) // block_size)
            blocks = torch.zeros(len(decode), longest, dtype=torch.long)
            mask = torch.zeros(len(decode), 1, 1, longest * block_size, dtype=torch.bool)
            for row, i in enumerate(decode):
                length = step.context_lens[i]
                table = blocks_of(step.block_tables[i], length)
                blocks[row, :len(table)] = table
                mask[row, ..., :length] = True
            self.decode_blocks, self.decode_mask = blocks.to(device), _additive(mask.to(device), dtype)
        self.prefills = []  # (first row, new tokens, context length, blocks, additive causal mask)
        for i, n in enumerate(step.query_lens):
            if n == 1:
                continue
            length = step.context_lens[i]
            # Query j sits at position (length - n) + j and sees the keys up to it.
            mask = _additive(torch.ones(n, length, dtype=torch.bool, device=device).tril(diagonal=length - n), dtype)
            self.prefills.append((starts[i], n, length, blocks_of(step.block_tables[i], length).to(device), mask))

    def attend(self, layer: int, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self._attend(layer, q_bhsd, k_bhsd, v_bhsd)
        self.seconds += time.perf_counter() - start
        return out

    def _attend(self, layer: int, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor) -> torch.Tensor:
        assert q_bhsd.shape[0] == 1, "the engine packs all sequences of a step into one row"
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]  # [blocks, block_size, kv_heads, dim]
        k_cache.flatten(0, 1)[self.slots] = k_bhsd[0].transpose(0, 1).to(k_cache.dtype)
        v_cache.flatten(0, 1)[self.slots] = v_bhsd[0].transpose(0, 1).to(v_cache.dtype)
        num_kv, dim = k_bhsd.shape[1], q_bhsd.shape[-1]
        groups = q_bhsd.shape[1] // num_kv
        out = torch.empty_like(q_bhsd)
        # Grouped-query attention without copying k/v per query head: the `groups` query heads that
        # share a kv head are one more dim of q (decode: extra query rows), k/v broadcast over it.
        if self.decode_blocks is not None:
            batch = self.decode_blocks.shape[0]
            q = q_bhsd[0, :, self.decode_rows].transpose(0, 1).reshape(batch, num_kv, groups, dim)
            k, v = self.buffers.gather(k_cache, v_cache, self.decode_blocks)
            k = k.flatten(1, 2).transpose(1, 2).to(q.dtype)  # [batch, kv_heads, len, dim]
            v = v.flatten(1, 2).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.decode_mask)
            out[0, :, self.decode_rows] = o.reshape(batch, num_kv * groups, dim).transpose(0, 1)
        for start, n, length, blocks, mask in self.prefills:
            q = q_bhsd[0, :, start:start + n].reshape(num_kv, groups, n, dim)
            k, v = self.buffers.gather(k_cache, v_cache, blocks)
            k = k.flatten(0, 1)[:length].transpose(0, 1)[:, None].to(q.dtype)  # [kv_heads, 1, len, dim]
            v = v.flatten(0, 1)[:length].transpose(0, 1)[:, None].to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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
        shape = (num_blocks, block_size, local_kv_heads(model), cfg.head_dim)
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
        # are computed for the sampling rows only, not for every prefill token.
        h = model.embed(tokens[None])
        cos, sin = rope_cos_sin(model.inv_freq, positions, h.dtype)
        for block in model.layers.values():
            h = block(h, cos, sin, ctx)
        h = h[0, torch.tensor(step.logits_indices, dtype=torch.long, device=self.device)]
        self.attention_seconds += getattr(ctx, "seconds", 0.0)
        return model.lm_head(model.norm(h)).float()
