"""Runs one engine step on the model: sizes the paged KV cache and turns a scheduler step into model input.

Responsible for: sizing the paged KV cache (a number of blocks, or as many as fit in a memory budget:
`DEFAULT_KV_CACHE_MB` per rank unless told) and allocating it per layer (its layout is `attention.py`'s);
turning a scheduler step into a plain `StepInput` (flat token ids, positions, slot mapping, block tables) --
plain data, which rank 0 sends to its tensor-parallel ranks each step (`infer/parallel.py`); and running the
reference model's own modules with a per-step attention context (`attention.PagedAttention` by default) that
the model's `Attention` calls. MoE layers run dropless (the capacity rule of training, if the model has one,
is turned off).
Each step first carries out the KV tier moves it carries (`move_kv`: blocks evicted from the cache copied to
host memory or disk, `infer/kv_tier_store.py`).
Not responsible for: attention over the cache (attention.py), the model's other math, scheduling, or
sampling (sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshlm.infer.attention import GatherBuffers, PagedAttention, new_kv_cache
from meshlm.infer.block_manager import DEFAULT_KV_CACHE_MB
from meshlm.infer.scheduler import SchedulerOutput
from meshlm.models.moe import MoE
from meshlm.models.transformer import Transformer


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
    # proposals per sequence (speculative decoding: the last of its new tokens; their rows' logits are wanted
    # too); empty: none in the whole step
    spec_lens: list[int] = field(default_factory=list)
    # KV tier moves to carry out before the step (`infer/kv_tiers.py`): blocks the scheduler evicted this step
    # are copied out before the step's tokens overwrite them
    kv_moves: list[list] = field(default_factory=list)
    # [seq_id, position] of each prompt position whose logits are wanted after the sampling rows (requests with
    # prompt_logprobs: position p's logits give prompt token p + 1's log-probability), in `logits_indices` order
    prompt_positions: list[list[int]] = field(default_factory=list)

    @property
    def num_sampling_rows(self) -> int:
        """The rows of the logits that are sampled from (the rest are `prompt_positions`')."""
        return len(self.logits_indices) - len(self.prompt_positions)

    @classmethod
    def from_schedule(cls, out: SchedulerOutput, block_size: int, *, kv_moves: list[list] | None = None) -> "StepInput":
        step = cls([], [], [], [], [], [], [], [], kv_moves or [])
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
            step.spec_lens.append(item.num_spec_tokens)
            if item.samples:
                last = len(step.token_ids)
                step.logits_indices.extend(range(last - 1 - item.num_spec_tokens, last))
        first = 0
        for item in out.scheduled:  # prompt positions after every sampling row
            seq, n = item.seq, item.num_new_tokens
            if seq.params.prompt_logprobs is not None:
                start = seq.num_computed_tokens
                for pos in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    step.logits_indices.append(first + pos - start)
                    step.prompt_positions.append([seq.seq_id, pos])
            first += n
        if not any(step.spec_lens):
            step.spec_lens = []
        return step

    def decode_rows(self) -> tuple[list[int], list[int], list[int]]:
        """The queries attended as decodes: (flat row, sequence, keys it sees) of each new token of every
        sequence that feeds one token and its proposals -- each a query of its own over the first position + 1
        keys of its sequence (its own and its proposals' keys written first). Every other sequence is a
        prefill chunk."""
        rows, seqs, lengths = [], [], []
        start = 0
        for i, n in enumerate(self.query_lens):
            if n - (self.spec_lens[i] if self.spec_lens else 0) == 1:
                first = self.context_lens[i] - n + 1
                rows.extend(range(start, start + n))
                seqs.extend([i] * n)
                lengths.extend(range(first, first + n))
            start += n
        return rows, seqs, lengths


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
    def __init__(self, model: Transformer, *, block_size: int = 32, num_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, kv_dtype: torch.dtype | None = None, attention=None,
                 native_attention: bool = True):
        """KV cache of `num_blocks` blocks, or as many as fit in `kv_cache_memory_bytes` (default
        `DEFAULT_KV_CACHE_MB` MiB, per rank: under tensor parallelism a block holds only this rank's kv heads,
        so the same budget holds tp times the blocks). `attention`: the class of the per-step attention context (default
        `PagedAttention`; context-parallel serving passes one that attends over this rank's blocks).
        `native_attention`: decodes over an fp32 cache on a CPU by the compiled kernel of `infer/native.py`
        where it builds (False: always the torch ops; the same numbers within fp32 rounding)."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1 (tokens per KV block; 16 or 32 are usual)")
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
            budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else DEFAULT_KV_CACHE_MB << 20
            num_blocks = budget // kv_block_bytes(model, block_size, self.kv_dtype)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of "
                                 f"{kv_block_bytes(model, block_size, self.kv_dtype)} bytes; give it more memory")
        self.num_blocks = num_blocks
        _check_fits(num_blocks * kv_block_bytes(model, block_size, self.kv_dtype), self.device)
        caches = [new_kv_cache(local_kv_heads(model), num_blocks, block_size, cfg.head_dim, dtype=self.kv_dtype,
                               device=self.device) for _ in range(cfg.num_layers)]
        self.k_caches, self.v_caches = [k for k, _ in caches], [v for _, v in caches]
        self.buffers = GatherBuffers()  # reused by every layer of every step
        self.attention = attention or PagedAttention
        self.native_attention = native_attention
        self.attention_seconds = 0.0  # PagedAttention's time, summed over steps (not under other `attention`)
        self.tier_store = None  # a `kv_tier_store.KVTierStore` when the cache has tiers below it (`build_runner`)

    def move_kv(self, moves: list[list]) -> list[int]:
        """Carry out this rank's share of KV tier moves; the indices of the loads from disk that failed here."""
        return self.tier_store.apply(moves) if moves else []

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run the step's tokens; return float32 logits [len(step.logits_indices), vocab] (under tensor
        parallelism this rank's vocab slice: the lm_head is split over the vocabulary)."""
        model = self.model
        self.move_kv(step.kv_moves)
        tokens = torch.tensor(step.token_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        ctx = self.attention(self.k_caches, self.v_caches, step, self.block_size, dtype=self.dtype,
                             buffers=self.buffers, native=self.native_attention)
        # The model's own modules; only attention is redirected to the paged cache (via `ctx`). Logits
        # are computed for the sampling rows only, not for every prefill token. An attention context with
        # `local_rows` (context-parallel serving) has this rank compute only those of the step's tokens.
        local = getattr(ctx, "local_rows", None)
        if local is not None:
            tokens, positions = tokens[local], positions[local]
        h = model.embed(tokens[None])
        cos, sin = model.rope(positions, h.dtype)
        for block in model.layers.values():
            h = block(h, cos, sin, ctx)
        if local is not None:
            h = ctx.select_rows(h)
        else:
            h = h[0, torch.tensor(step.logits_indices, dtype=torch.long, device=self.device)]
        self.attention_seconds += getattr(ctx, "seconds", 0.0)
        return model.lm_head(model.norm(h)).float()


def _check_fits(cache_bytes: int, device: torch.device) -> None:
    """ValueError when a KV cache of `cache_bytes` is more than the memory of the device it goes on (a GPU's, or on
    a CPU this host's): asked for as --kv-cache-mb, it would otherwise fail in the allocator's traceback."""
    if device.type == "cuda":
        have, what = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    else:
        from meshlm.host_memory import host_memory_bytes

        have, what = host_memory_bytes(), "this host's memory"
    if have is not None and cache_bytes > have:
        raise ValueError(f"a KV cache of {cache_bytes / (1 << 20):,.0f} MiB (kv_cache_memory_bytes, --kv-cache-mb) is "
                         f"more than {what} ({have / (1 << 20):,.0f} MiB); give it a share of that memory")
