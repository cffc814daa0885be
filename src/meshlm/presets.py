"""The model presets: `ModelConfig.from_preset(name)`'s shapes (`meshlm train --set model.preset=...`, the
planner's `--model NAME`).

Responsible for: `MODEL_PRESETS`, each preset's ModelConfig fields.
Not responsible for: checking them (config.py validates every ModelConfig), or Hugging Face configs
(hf_config.py).
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # A few million parameters, byte-level vocabulary: trains on a laptop CPU in minutes.
    "tiny": dict(vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=768, max_seq_len=256, rope_theta=10000.0, norm_eps=1e-5),
    # Tiny MoE twin, for tests and CPU demos of expert parallelism.
    "tiny-moe": dict(vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=384, max_seq_len=256, num_experts=8, num_experts_per_token=2,
                     moe_intermediate_size=128, num_shared_experts=1, first_dense_layers=1),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, max_seq_len=131072, rope_theta=500000.0,
                      rope_scaling=_LLAMA3_ROPE, norm_eps=1e-5),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       intermediate_size=28672, max_seq_len=131072, rope_theta=500000.0,
                       rope_scaling=_LLAMA3_ROPE, norm_eps=1e-5),
    "llama3-405b": dict(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128,
                        num_kv_heads=8, intermediate_size=53248, max_seq_len=131072, rope_theta=500000.0,
                        rope_scaling=_LLAMA3_ROPE, norm_eps=1e-5),
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         intermediate_size=14336, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                         num_experts=8, num_experts_per_token=2, router_aux_loss_coef=0.02),
    # DeepSeek-V3 dimensions (671B total, ~37B active). meshlm's model of its multi-head latent attention is
    # grouped-query attention of the same width (688B, ~55B active; the planner prices the latent attention itself,
    # planner/mla.py); routing as softmax top-k. 3 leading dense layers, 256 routed experts (8 active) + 1 shared.
    "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
                        head_dim=128, intermediate_size=18432, max_seq_len=163840, rope_theta=10000.0,
                        norm_eps=1e-6, num_experts=256, num_experts_per_token=8, moe_intermediate_size=2048,
                        num_shared_experts=1, first_dense_layers=3, router_aux_loss_coef=0.0001),
}
