"""The reference decoder: a Llama-style transformer in plain PyTorch, on one device.

Responsible for: embedding, RMSNorm, RoPE (with Llama-3 frequency scaling), grouped-query attention
through `scaled_dot_product_attention` (optional q/k norm, optional q/k/v bias; block-causal over the
documents of packed samples when given `documents`, `meshlm.models.documents`), SwiGLU MLP or MoE per
layer, tied or untied output head, an optional contiguous KV cache for generation, and a deterministic
initialisation that depends only on (seed, parameter name) -- never on how the model is sharded.
Not responsible for: any parallelism (strategies are transforms in `meshlm.parallel`), loss
functions, or the paged KV cache of the inference engine.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.config import ModelConfig
from meshlm.models.documents import attention_mask, document_positions
from meshlm.models.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # bf16 -> fp32; fp64 stays fp64
        # x / sqrt(mean(x^2) + eps) in one kernel (the same bits as spelling it out, 2-3x faster on CPU);
        # the weight multiplies after the cast back, as Hugging Face's Llama does.
        x = F.rms_norm(x, (x.shape[-1],), eps=self.eps).to(dtype)
        if not torch.is_grad_enabled() and self.weight.dtype == dtype:  # inference: in place (same bits)
            return x.mul_(self.weight)
        return self.weight * x


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of RoPE, scaled where `config.rope_scaling` says (its `rope_type`, as Hugging Face names
    them): llama3 (Llama 3.1's: the low frequencies divided by `factor`, a smooth band between), yarn (YaRN, Peng
    et al. 2023: frequencies that turn fewer than `beta_slow` times over the original context are interpolated by
    `factor`, those that turn more than `beta_fast` times kept, a linear ramp over the dimensions between) or
    linear (positions divided by `factor`)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    kind, factor = config.rope_type, rs["factor"]
    if kind == "linear":
        return inv_freq / factor
    old_len = rs["original_max_position_embeddings"]
    if kind == "yarn":
        def dimension(turns: float) -> float:  # the dimension whose frequency turns `turns` times over old_len
            return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low, high = dimension(rs.get("beta_fast") or 32), dimension(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        kept = 1 - ramp  # the share of each frequency kept as trained (extrapolated)
        return 1.0 / (factor * config.rope_theta ** exponents) * (1 - kept) + inv_freq * kept
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_attention_factor(config: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (its `attention_factor`, else 0.1 ln(factor) + 1, or DeepSeek's ratio of
    two such terms with `mscale` / `mscale_all_dim`); 1 for every other RoPE."""
    rs = config.rope_scaling
    if config.rope_type != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])

    def mscale(m: float) -> float:
        return 1.0 if rs["factor"] <= 1 else 0.1 * m * math.log(rs["factor"]) + 1.0

    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(rs["mscale"]) / mscale(rs["mscale_all_dim"])
    return mscale(1.0)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos/sin of shape [..., seq, head_dim] for integer `positions` of shape [..., seq], the first half of sin
    negated: what `apply_rope` takes (the sign of the rotated half lives here, once per step, not once per
    head and layer); both times `scale` (`rope_attention_factor`)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    half = sin.shape[-1] // 2
    return cos.to(dtype), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).to(dtype)


def rope_positions(seq: int, *, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                   start: int = 0, device=None) -> torch.Tensor:
    """The positions RoPE rotates `seq` tokens by: `positions` (their indices in the sequence) or start..start+seq-1;
    with `documents` (the whole sequences' document ids) the position of those tokens within their document,
    [batch, seq]."""
    if documents is not None:
        return document_positions(documents, positions)
    if positions is not None:
        return positions
    return torch.arange(start, start + seq, device=device)


def apply_rope(x_bhsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the Hugging Face convention, so checkpoints load without permuting): x * cos +
    cat(-x2, x1) * sin, computed as x * cos + cat(x2, x1) * sin' with sin' from `rope_cos_sin` (its first half
    negated): the same bits in four passes over x instead of five."""
    if cos.dim() == 2:
        cos, sin = cos[None, None], sin[None, None]
    else:  # [batch, seq, dim]
        cos, sin = cos[:, None], sin[:, None]
    # in q/k's own dtype: bf16 q/k under autocast times fp32 cos/sin would come out fp32, and everything after
    # (attention, the K/V context parallelism ships) would run in fp32 (as Hugging Face, in the input's dtype)
    cos, sin = cos.to(x_bhsd.dtype), sin.to(x_bhsd.dtype)
    half = x_bhsd.shape[-1] // 2
    rotated = torch.cat([x_bhsd[..., half:], x_bhsd[..., :half]], dim=-1)
    return (x_bhsd * cos).add_(rotated.mul_(sin))


class KVCache:
    """A contiguous per-layer KV cache for single-process generation: [batch, kv_heads, max_len, head_dim]."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, *, device=None, dtype=torch.float32):
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.length = 0  # tokens already stored (the same for every row)
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store new k/v at positions [length, length + new) and return the whole prefix."""
        new = k.shape[2]
        end = self.length + new
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} were asked for")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.wq = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0, documents: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # Head counts are read from the projection widths so that a tensor-parallel transform that
        # shards wq/wk/wv by heads needs no change here.
        # (Counted, not -1: a rank of context-parallel serving may get no token of a step.)
        heads, kv_heads = self.wq.out_features // self.head_dim, self.wk.out_features // self.head_dim
        q_bhsd = self.wq(x).view(bsz, seq, heads, self.head_dim).transpose(1, 2)
        k_bhsd = self.wk(x).view(bsz, seq, kv_heads, self.head_dim).transpose(1, 2)
        v_bhsd = self.wv(x).view(bsz, seq, kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q_bhsd, k_bhsd = self.q_norm(q_bhsd), self.k_norm(k_bhsd)
        q_bhsd, k_bhsd = apply_rope(q_bhsd, cos, sin), apply_rope(k_bhsd, cos, sin)
        if hasattr(cache, "attend"):
            # A cache that runs attention itself (the inference engine's paged KV cache): it stores
            # k/v where its block tables say and returns [batch, heads, seq, head_dim].
            out = cache.attend(layer, q_bhsd, k_bhsd, v_bhsd)
            return self.wo(out.transpose(1, 2).reshape(bsz, seq, heads * self.head_dim))
        if cache is None:
            return self.wo(self.core(q_bhsd, k_bhsd, v_bhsd, documents))
        past = cache.length
        k_bhsd, v_bhsd = cache.update(layer, k_bhsd, v_bhsd)
        groups = q_bhsd.shape[1] // k_bhsd.shape[1]
        if groups > 1:
            k_bhsd = k_bhsd.repeat_interleave(groups, dim=1)
            v_bhsd = v_bhsd.repeat_interleave(groups, dim=1)
        if past == 0:
            out = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, is_causal=seq > 1)
        elif seq == 1:
            out = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd)
        else:  # a chunk after a cached prefix: query i sees keys up to past + i
            total = k_bhsd.shape[2]
            mask = torch.ones(seq, total, dtype=torch.bool, device=x.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, attn_mask=mask)
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        return self.wo(out)

    def core(self, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor,
             documents: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over a whole sequence (no cache): [batch, heads, seq, head_dim] in,
        [batch, seq, heads * head_dim] out; with `documents` ([batch, seq], `meshlm.models.documents`)
        block-causal: a query sees only the keys of its own document. A method of its own, with no
        parameters, so that a transform can replace it (selective activation recomputation,
        `meshlm.parallel.recompute`; context parallelism, `meshlm.parallel.context`)."""
        bsz, _, seq, _ = q_bhsd.shape
        groups = q_bhsd.shape[1] // k_bhsd.shape[1]
        if groups > 1:
            k_bhsd = k_bhsd.repeat_interleave(groups, dim=1)
            v_bhsd = v_bhsd.repeat_interleave(groups, dim=1)
        if documents is None:
            out = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, is_causal=seq > 1)
        else:  # one boolean mask over the batch's sequences, shared by the heads
            mask = attention_mask(documents)[:, None]
            out = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, attn_mask=mask)
        return out.transpose(1, 2).reshape(bsz, seq, -1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w_gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w_up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w_down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.act(self.w_gate(x), self.w_up(x)))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: a method of its own so that a transform can replace it (selective
        activation recomputation, `meshlm.parallel.recompute`)."""
        if not torch.is_grad_enabled():  # inference: nothing kept for backward, reuse gate's memory (same bits)
            return F.silu(gate, inplace=True).mul_(up)
        return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(layer) else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, cache: KVCache | None = None, documents: torch.Tensor | None = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, self.layer, documents=documents)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """`forward(tokens [batch, seq]) -> logits [batch, seq, vocab]`.

    `positions`: the indices in the sequence of the tokens given (context parallelism: a rank's chunks' true
    positions); None: 0..seq-1 (after a KV cache's length). `documents` (data.document_mask): the whole
    sequences' document ids [batch, seq] (`meshlm.models.documents`, whatever part of them `tokens` is):
    attention stops at document boundaries and RoPE counts positions from each document's start.

    Layers live in a `ModuleDict` keyed by their global index ("0", "1", ...), so a pipeline stage
    that keeps a subset keeps the same parameter names as the full model (checkpoints stay portable).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.num_layers)})
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # A plain tensor, not a buffer: `.to(dtype)` must not round the frequencies to bf16.
        with torch.device("cpu"):
            self.inv_freq = rope_inv_freq(config)
        self.rope_scale = rope_attention_factor(config)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) at `positions`, with the model's frequencies and attention factor: what every forward
        over its blocks (this one, a pipeline stage's, the serving runner's) hands them."""
        return rope_cos_sin(self.inv_freq, positions, dtype, self.rope_scale)

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        if documents is not None and cache is not None:
            raise ValueError("documents (block-causal attention of packed samples) are for training and "
                             "evaluation; generation with a KV cache takes one document: pass documents=None")
        h = self.embed(tokens) if self.embed is not None else tokens
        seq = h.shape[1]
        positions = rope_positions(seq, positions=positions, documents=documents,
                                   start=cache.length if cache is not None else 0, device=h.device)
        cos, sin = self.rope(positions, h.dtype)
        for block in self.layers.values():
            h = block(h, cos, sin, cache, documents=documents)
        if cache is not None:
            cache.length += seq
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the MoE load-balancing losses of the last forward, weighted by the config's coefficient."""
        losses = [m.last_aux_loss for m in self.modules() if isinstance(m, MoE) and m.last_aux_loss is not None]
        if not losses:
            return 0.0
        return self.config.router_aux_loss_coef * torch.stack(losses).sum()

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen or (exclude_embedding and name.startswith("embed.")):
                continue
            seen.add(id(p))
            total += p.numel()
        return total


# --------------------------------------------------------------------------------------------
# Deterministic initialisation
# --------------------------------------------------------------------------------------------


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (seed, parameter name): the same on every rank and every layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


INIT_BLOCK_ELEMENTS = 1 << 20  # random initial values come in blocks of whole rows of about this many elements


def init_rows_per_block(shape) -> int:
    """Rows (along dim 0) in one block of a parameter's random initial values."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, INIT_BLOCK_ELEMENTS // max(row, 1))


def init_param(name: str, shape: torch.Size | tuple[int, ...], config: ModelConfig, seed: int,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The initial value of parameter `name`: whole, or rows [start, stop) of it along dim 0 (`rows`).

    Random values are drawn in blocks of whole rows (`init_rows_per_block`), block i from its own (seed, name, i)
    stream, so a rank that holds some rows draws only their blocks -- a ZeRO-3 shard, a row-split TP slice, a
    pipeline stage's layers -- and the values are the same whoever draws them."""
    if name == "lm_head.weight" and config.tie_embeddings:
        name = "embed.weight"  # one weight: a pipeline's last stage, which holds only the head, starts from it too
    shape = tuple(shape)
    start, stop = rows if rows is not None else (0, shape[0] if shape else 1)
    part = (stop - start, *shape[1:]) if shape else ()
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return torch.ones(part)
    if leaf == "bias":
        return torch.zeros(part)
    std = config.init_std
    # Output projections of residual branches are scaled down with depth (GPT-2 / Megatron style).
    if any(name.endswith(s) for s in ("wo.weight", "w_down.weight", "w_down")):
        std = std / math.sqrt(2 * config.num_layers)
    if not shape:
        return torch.randn((), generator=param_generator(seed, name)) * std
    per = init_rows_per_block(shape)
    first, last = start // per, max(start, stop - 1) // per
    blocks = [torch.randn((min(per, shape[0] - i * per), *shape[1:]), generator=param_generator(seed, f"{name}#{i}"))
              for i in range(first, last + 1)]
    return torch.cat(blocks)[start - first * per:stop - first * per] * std


@torch.no_grad()
def init_weights(model: nn.Module, config: ModelConfig, seed: int) -> None:
    """Fill every parameter from its (seed, name) stream. Tied weights are filled once."""
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        p.copy_(init_param(name, p.shape, config, seed).to(p.dtype))


def build_model(config: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, materialize: bool = True) -> Transformer:
    """Construct and deterministically initialise the reference model. `materialize=False`: leave every
    parameter on the meta device (shapes only, no memory), for whoever fills in only the parts it needs;
    each parameter's values are `init_param(name, ...)` whoever computes them."""
    with torch.device("meta"):
        model = Transformer(config)
    if not materialize:
        return model
    model = model.to_empty(device="cpu")
    # to_empty gives each module its own new tensor, which unties lm_head from embed: tie again.
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    init_weights(model, config, seed)
    return model.to(device=device, dtype=dtype)
