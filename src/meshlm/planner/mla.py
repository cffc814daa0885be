"""DeepSeek's multi-head latent attention (MLA) in the quantities the planner costs, for serving and training alike.

Responsible for: the `MLA` dimensions (read from a config.json's kv_lora_rank, qk_rope_head_dim, q_lora_rank,
qk_nope_head_dim, v_head_dim; `MLA_PRESETS` for the deepseek-v3 preset), the latent attention's parameters by how
tensor parallelism shards them, its forward GEMMs on one rank, its attention core's FLOPs and the activations it
keeps for the backward. Torch-free.
Not responsible for: running it -- `meshlm.models` implements no MLA: `ModelConfig` models DeepSeek's attention as
grouped-query attention of the same width, which is what meshlm's own runtime trains (`latent_attention`).

MLA (DeepSeek-V2, Liu et al. 2024, arXiv:2405.04434, Sec. 2.1; DeepSeek-V3 config.json), per layer: the query is
compressed to `q_lora_rank` and expanded per head to nope + rope dims (W_DQ h x q_lora, W_UQ q_lora x heads (nope +
rope); a single W_Q h x heads (nope + rope) where q_lora_rank is 0); keys and values share one compressed latent of
`kv_lora_rank` plus a decoupled RoPE key of `qk_rope_head_dim` shared by all heads (W_DKV + W_KR h x (kv_lora +
rope)), expanded per head (W_UK and W_UV kv_lora x heads (nope + v)); the output projection is heads v x h. An
RMSNorm on each latent (q_lora and kv_lora elements).

How Megatron-Core shards it under tensor parallelism (megatron/core/transformer/multi_latent_attention.py and the
Transformer Engine layer spec, gpt_layer_specs.py, at NVIDIA/Megatron-LM d98e8a6): the down-projections are
`TELinear` with parallel_mode 'duplicated' -- whole on every tp rank, each rank projecting its own 1 / tp of the
tokens under sequence parallelism (Megatron-Core requires it beside tensor parallelism for MoE models) --, the
up-projections column-parallel and the output projection row-parallel, split by heads. The attention core runs
per head with q and k of nope + rope dims and v of v dims.

The training side (`cost.ModelSummary`, `kernels.layer_gemms`) takes from here the parameters, GEMMs, core FLOPs
and kept activations; what it still prices as the grouped-query attention of the same width: the elementwise
work around the attention (RoPE over every q / k dim where MLA rotates 64 a head), the tensor-parallel collectives
(the hidden state gathered under sequence parallelism, where Megatron-Core gathers the smaller latents) and the
K / V blocks a context-parallel ring passes.

DeepSeek's models also limit the nodes a token's experts lie on (group-limited routing: `router_groups`, priced by
`collectives.other_nodes_reached`); read from the same config.json (n_group, topk_group), kept here beside the MLA.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.config import ModelConfig
from meshlm.models import stats as model_stats


@dataclass(frozen=True)
class MLA:
    kv_lora_rank: int
    qk_rope_head_dim: int
    q_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# DeepSeek-V3 / R1's config.json (deepseek-ai/DeepSeek-V3): kv_lora_rank 512, qk_rope_head_dim 64,
# q_lora_rank 1536, qk_nope_head_dim 128, v_head_dim 128.
MLA_PRESETS = {"deepseek-v3": MLA(512, 64, 1536, 128, 128)}
# Its router's groups (the same config.json): n_group 8, topk_group 4 -- a token's 8 experts from 4 of 8 groups of 32.
ROUTER_GROUPS = {"deepseek-v3": (8, 4)}


@dataclass
class LatentConfig(ModelConfig):
    """A model read from a DeepSeek-style config.json (`kv_lora_rank`: DeepSeek-V2 / V3, Kimi K2, ...) for the
    planner: its body as `ModelConfig` (the attention as grouped-query attention of the same width) and its latent
    attention, `mla`. meshlm's runtime builds no latent attention, so only the planner takes one
    (`inputs.resolve_model`)."""

    mla: MLA | None = None
    router_groups: tuple[int, int] = (1, 1)  # config.json's (n_group, topk_group): `router_groups`


def router_groups(cfg: ModelConfig) -> tuple[int, int]:
    """`cfg`'s router groups (n_group, topk_group): a token's experts come from topk_group of n_group contiguous
    groups -- a DeepSeek config.json's (`LatentConfig`) or its preset's; (1, 1), unlimited, for any other model."""
    return cfg.router_groups if isinstance(cfg, LatentConfig) else ROUTER_GROUPS.get(cfg.preset or "", (1, 1))


def model_latent_attention(cfg: ModelConfig) -> MLA | None:
    """`cfg`'s own latent attention: a config.json's (`LatentConfig`) or its preset's; None for any other model."""
    return cfg.mla if isinstance(cfg, LatentConfig) else MLA_PRESETS.get(cfg.preset or "")


def latent_attention(cfg: ModelConfig, runtime: str) -> MLA | None:
    """The MLA a training estimate prices for `cfg` (`model_latent_attention`) -- unless the job runs on meshlm's own
    runtime (`Job.runtime` "meshlm"), whose model of the preset is grouped-query attention of the same width and which
    cannot build a config.json's latent attention (refused, naming the fix)."""
    if runtime == "meshlm":
        if isinstance(cfg, LatentConfig) and cfg.mla is not None:
            raise ValueError("meshlm's own runtime implements no multi-head latent attention (this config.json's "
                             "kv_lora_rank): plan it with --runtime megatron")
        return None
    return model_latent_attention(cfg)


def total_params(cfg: ModelConfig, runtime: str) -> int:
    """The model's parameters as a training estimate prices them (what its checkpoint holds): models/stats.py's
    count, with the latent attention's in place of the grouped-query attention's where `latent_attention` applies."""
    total = model_stats.count_params(cfg)["total"]
    m = latent_attention(cfg, runtime)
    if m is None:
        return total
    return total + cfg.num_layers * (sum(matmul_params(cfg, m)) + norm_params(m)
                                     - model_stats.layer_params(cfg, 0).attention)


def matrices(cfg: ModelConfig, m: MLA) -> list[tuple[int, int, str]]:
    """One layer's latent-attention weight matrices as (N, K, split), in the order they run: how tensor parallelism
    splits each -- "none" (the down-projections, whole on every tp rank), "n" (the column-parallel up-projections, by
    heads), "k" (the row-parallel output projection, by heads)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    q = ([(m.q_lora_rank, h, "none"), (heads * m.qk_head_dim, m.q_lora_rank, "n")] if m.q_lora_rank
         else [(heads * m.qk_head_dim, h, "n")])
    return [*q, (m.kv_lora_rank + m.qk_rope_head_dim, h, "none"),
            (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "n"), (h, heads * m.v_head_dim, "k")]


def matmul_params(cfg: ModelConfig, m: MLA) -> tuple[int, int]:
    """(tp-sharded, replicated) weight-matrix parameters of one layer's latent attention (`matrices`)."""
    shapes = matrices(cfg, m)
    return (sum(n * k for n, k, split in shapes if split != "none"),
            sum(n * k for n, k, split in shapes if split == "none"))


def norm_params(m: MLA) -> int:
    """The latents' RMSNorm weights (replicated)."""
    return m.q_lora_rank + m.kv_lora_rank


def forward_gemms(cfg: ModelConfig, m: MLA, *, tokens: float, tp: int, sequence_parallel: bool) -> list[tuple]:
    """One layer's latent-attention GEMMs on one rank for a microbatch of `tokens`, as kernels.layer_gemms' (m, n, k,
    count): the down-projections over the rank's 1 / tp of the tokens under sequence parallelism (all of them
    without), the up- and output projections over every token on 1 / tp of the heads."""
    own = tokens / tp if sequence_parallel and tp > 1 else tokens
    return [(own if split == "none" else tokens, n / tp if split == "n" else n, k / tp if split == "k" else k, 1.0)
            for n, k, split in matrices(cfg, m)]


def core_flops_per_token(cfg: ModelConfig, m: MLA, seq_len: int) -> float:
    """The attention core's forward FLOPs per token and layer, over the full s x s square as `models/stats.py`
    counts grouped-query attention's: q k^T on nope + rope dims, p v on v dims, per head."""
    return 2.0 * seq_len * cfg.num_heads * (m.qk_head_dim + m.v_head_dim)


def activation_elems(cfg: ModelConfig, m: MLA, *, up_proj_recomputed: bool = False) -> tuple[float, float]:
    """Elements one token keeps for the backward in one layer's latent attention when the layer is not recomputed,
    as (tp-sharded, sequence-only) -- models/stats.py's split: q and k (nope + rope per head), v and the attention
    output (v per head), by heads; the two latents' norm inputs and outputs (the up-projections' inputs), whole per
    token, split by tp only under sequence parallelism. `up_proj_recomputed` (`Job.recompute_mla_up_proj`): of the
    heads' tensors the attention output only, q, k and v rebuilt from the latents in the backward."""
    heads = cfg.num_heads
    by_heads = m.v_head_dim if up_proj_recomputed else 2 * m.qk_head_dim + 2 * m.v_head_dim
    return float(heads * by_heads), 2.0 * (m.q_lora_rank + m.kv_lora_rank)


def up_projection_gemms(cfg: ModelConfig, m: MLA, *, tokens: float, tp: int) -> list[tuple]:
    """The GEMMs `Job.recompute_mla_up_proj` runs again in the backward, as kernels.layer_gemms' (m, n, k, count): the
    column-parallel up-projections of `matrices` (q's from its latent -- from the hidden state without one -- and k /
    v's from theirs) over every token on 1 / tp of the heads, the forward's shapes (`forward_gemms`)."""
    return [(tokens, n / tp, k, 1.0) for n, k, split in matrices(cfg, m) if split == "n"]
