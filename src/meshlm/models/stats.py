"""Exact parameter counts and matmul FLOPs of the meshlm model, from a `ModelConfig` alone.

Responsible for: the number of parameters of every part of `meshlm.models.Transformer` (checked
against the real module in the tests), the matmul FLOPs of one token's forward pass, and the
activation bytes a layer keeps for backward. These numbers feed the planner's cost model, the
trainer's MFU and `meshlm info`.
Not responsible for: anything that depends on a parallel layout (see `meshlm.planner.cost`), or
torch (imports none: the planner runs without it).

FLOP convention (stated once, used everywhere):
  * Only matrix multiplications are counted, 2 FLOPs per multiply-add; biases, norms, softmax,
    RoPE and elementwise ops are not (they are memory-bound and modelled as HBM traffic instead).
  * Attention scores and the attention-weighted sum are counted over the FULL s x s square, even
    though causal masking makes half of it zero: 2 * 2 * s * (num_heads * head_dim) per token and
    layer. This is the convention of Megatron-LM (Narayanan et al. 2021, eq. 3) and PaLM
    (6N + 12 L h s per token for training), and it is also what `torch.utils.flop_counter` counts
    for `scaled_dot_product_attention(is_causal=True)`, so published MFU figures and a counter
    agree with ours.
  * MoE layers count only the active experts (top-k per token, plus shared experts and router).
  * The embedding lookup is free; the output head is a full `hidden x vocab` matmul.
  * Training = forward + backward = 3 x forward (backward computes input and weight gradients).
    Model FLOPs (for MFU) never include recomputation; hardware FLOPs (for HFU) do.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.config import ModelConfig
from meshlm.rules import RECOMPUTE_MODES


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, split by how tensor/expert parallelism shards them."""

    attention: int  # wq, wk, wv, wo (+ q/k/v bias): sharded by tp
    mlp: int  # dense SwiGLU or shared experts: sharded by tp
    experts: int  # all routed experts: sharded by ep (and tp)
    experts_active: int  # the top-k experts one token uses
    replicated: int  # norms, q/k norms, router, shared-expert gate: replicated across tp

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.experts + self.replicated

    @property
    def active(self) -> int:
        return self.attention + self.mlp + self.experts_active + self.replicated


def layer_params(cfg: ModelConfig, layer: int) -> LayerParams:
    h, hd = cfg.hidden_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h
    if cfg.attention_bias:
        attention += q_dim + 2 * kv_dim
    replicated = 2 * h + (2 * hd if cfg.qk_norm else 0)
    if not cfg.is_moe_layer(layer):
        return LayerParams(attention, 3 * h * cfg.intermediate_size, 0, 0, replicated)
    expert = 3 * h * cfg.expert_intermediate_size
    shared = 3 * h * cfg.shared_intermediate_size
    replicated += h * cfg.num_experts  # router
    if cfg.shared_intermediate_size > 0 and cfg.shared_expert_gate:
        replicated += h
    return LayerParams(attention, shared, cfg.num_experts * expert, cfg.num_experts_per_token * expert,
                       replicated)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts of `build_model(cfg)` (tied weights counted once).

    Keys: total, embedding (input embedding), lm_head (0 when tied), attention, mlp (dense MLPs and
    shared experts), experts (all routed experts), norms_router (replicated small tensors incl. the
    final norm), non_embedding (total minus embedding and an untied head), active (parameters one
    token touches: routed experts counted top-k, the embedding row lookup counted in full as is usual).
    """
    layers = [layer_params(cfg, i) for i in range(cfg.num_layers)]
    embedding = cfg.vocab_size * cfg.hidden_size
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    final_norm = cfg.hidden_size
    total = embedding + lm_head + final_norm + sum(p.total for p in layers)
    active = embedding + lm_head + final_norm + sum(p.active for p in layers)
    return {
        "total": total,
        "embedding": embedding,
        "lm_head": lm_head,
        "attention": sum(p.attention for p in layers),
        "mlp": sum(p.mlp for p in layers),
        "experts": sum(p.experts for p in layers),
        "norms_router": final_norm + sum(p.replicated for p in layers),
        "non_embedding": total - embedding - lm_head,
        "active": active,
    }


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerFlops:
    """Forward matmul FLOPs of one token through one layer at sequence length s."""

    dense: int  # projections, MLP / active experts, router: scale with tokens
    attention_core: int  # q @ k^T and p @ v over the full s x s square

    @property
    def total(self) -> int:
        return self.dense + self.attention_core


def layer_flops(cfg: ModelConfig, layer: int, seq_len: int) -> LayerFlops:
    p = layer_params(cfg, layer)
    q_dim = cfg.num_heads * cfg.head_dim
    # Every weight matrix is used once per token; bias and norm vectors are not matmuls.
    matmul_params = p.attention - (q_dim + 2 * cfg.num_kv_heads * cfg.head_dim if cfg.attention_bias else 0)
    matmul_params += p.mlp + p.experts_active
    if cfg.is_moe_layer(layer):
        matmul_params += cfg.hidden_size * cfg.num_experts  # router
        if cfg.shared_intermediate_size > 0 and cfg.shared_expert_gate:
            matmul_params += cfg.hidden_size
    return LayerFlops(dense=2 * matmul_params, attention_core=2 * 2 * seq_len * q_dim)


def pipeline_units(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(head_units, embed_units): the pipeline's end-stage extras in units of one average block's forward
    FLOPs per token at `seq_len`, what `schedules.balanced_split` balances. The output head is
    its matmul (2 x hidden x vocab; the loss's softmax, ~vocab FLOPs, is left out as the planner leaves it
    out); the embedding is a lookup, 0 FLOPs. The same arithmetic as the planner's `ModelSummary`."""
    L = cfg.num_layers
    flops = [layer_flops(cfg, i, seq_len) for i in range(L)]
    block = sum(f.dense for f in flops) / L + sum(f.attention_core for f in flops) / L
    return 2 * cfg.hidden_size * cfg.vocab_size / block, 0.0


def forward_flops_breakdown(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward matmul FLOPs per token by part: layers_dense, attention_core, lm_head, total."""
    flops = [layer_flops(cfg, i, seq_len) for i in range(cfg.num_layers)]
    out = {"layers_dense": sum(f.dense for f in flops), "attention_core": sum(f.attention_core for f in flops),
           "lm_head": 2 * cfg.hidden_size * cfg.vocab_size}
    out["total"] = sum(out.values())
    return out


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward matmul FLOPs of one token in a sequence of `seq_len` (training = 3x, see module doc)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    return forward_flops_breakdown(cfg, seq_len)["total"]


def train_flops_per_token(cfg: ModelConfig, seq_len: int, *, recompute: str = "none") -> int:
    """Training FLOPs per token: model FLOPs (recompute='none', for MFU) or hardware FLOPs with the
    recomputation a policy adds (for HFU). 'selective' recomputes the attention core; 'full'
    recomputes every layer's forward (not the output head, which is never checkpointed)."""
    f = forward_flops_breakdown(cfg, seq_len)
    extra = {"none": 0, "selective": f["attention_core"],
             "full": f["layers_dense"] + f["attention_core"]}
    if recompute not in extra:
        raise ValueError(f"recompute={recompute!r} must be none, selective or full")
    return 3 * f["total"] + extra[recompute]


# --------------------------------------------------------------------------------------------
# Activations kept for backward
# --------------------------------------------------------------------------------------------


def activation_elems_per_token(cfg: ModelConfig, layer: int, *, recompute: str,
                               eager: bool = False) -> tuple[float, float]:
    """Elements one token keeps for backward in `layer`, split as (tp_sharded, sequence_only).

    `tp_sharded` elements are split by tensor parallelism (per-head and per-column tensors);
    `sequence_only` ones (inputs of the two norms, the residual stream) are split by tp only under
    sequence parallelism. A fused attention kernel is assumed (no s x s matrix is stored; the caller
    adds the scores of an unfused one).

    none:      norm inputs and outputs (4h), q, k, v, attention output, SwiGLU gate, up and product.
    selective: meshlm's `parallel.recompute=selective` recomputes the attention core and the SwiGLU
               activation. Their inputs (q, k, v; gate, up) and outputs (the inputs of wo and w_down,
               which those matmuls keep for their weight gradients) stay, so with fused kernels it
               keeps what none keeps: it frees only what an unfused implementation holds inside the
               two -- the s x s scores, and what `eager` lists below.
    full:      only the layer input (h); everything else is recomputed in backward.
    eager:     meshlm's model as PyTorch runs it op by op (`Job(fused_elementwise=False)`, cluster
               `local`): each RMSNorm also keeps its normalised input and 1/rms (h + 1, twice); inside the
               attention core the k and v expanded to every query head (GQA repeat: 2 (q_dim - kv_dim)
               more) and the kernel's log-sum-exp (num_heads); inside the activation silu(gate) (its
               width). Selective recomputation frees those inside the core and the activation.
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
    if cfg.is_moe_layer(layer):
        # Each token's hidden state is copied to k experts (dispatch buffer) and each expert keeps its own
        # gate/up/product; the shared experts keep theirs; the router logits are small.
        inter = cfg.num_experts_per_token * cfg.expert_intermediate_size + cfg.shared_intermediate_size
        dispatch = cfg.num_experts_per_token * h + cfg.num_experts
    else:
        inter, dispatch = cfg.intermediate_size, 0
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} must be none, selective or full")
    if recompute == "full":
        return 0.0, float(h)
    tp_sharded, sequence_only = q_dim + 2 * kv_dim + q_dim + 3 * inter + dispatch, 4.0 * h
    if eager:
        sequence_only += 2 * (h + 1)
        if recompute == "none":
            tp_sharded += 2 * (q_dim - kv_dim) + cfg.num_heads + inter
    return tp_sharded, sequence_only
