"""The planner's per-rank model-state memory equals the bytes real data-parallel ranks hold.

Two gloo ranks train one step (two accumulation micro-batches, the bucketed all-reduce of
`meshlm.parallel.data`, AdamW, fp32) for a few model variants and bucket sizes, and count exactly,
on each rank: parameter bytes, gradient bytes, AdamW state tensor bytes (exp_avg, exp_avg_sq) and the
data-parallel bucket buffers. The planner's `weights`, `gradients`, `optimizer` and `comm_buffers`
for the same layout (dp_shard=2, zero_stage=0, precision fp32) must equal them.

"Equal up to padding": a sharded layout (ZeRO, once it exists) pads each flat shard to a multiple of
the shard count, so the planner's ceil(params / shards) may differ from a rank's bytes by less than
one element per shard and flat buffer. Plain data parallelism shards nothing, so there is no padding
and the comparison is exact. AdamW's per-tensor `step` counter (a 4-byte scalar per parameter
tensor) is bookkeeping, not model state; it is counted and checked to be exactly that, separately.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.config import ModelConfig
from meshlm.planner import estimate
from meshlm.planner.cost import Layout

BASE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
            max_seq_len=16)
VARIANTS = {
    "gqa": dict(),
    "tied_bias_qknorm": dict(tie_embeddings=True, attention_bias=True, qk_norm=True),
    "moe": dict(num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
                shared_expert_gate=True, first_dense_layers=1),
}
BUCKETS_MB = (0.002, 25.0)  # many small buckets, and one bucket holding everything
GLOBAL_BATCH, MICRO_BATCH, SEQ = 4, 1, 8  # 2 ranks x 2 accumulation micro-batches of 1 sequence


def count_worker(rank, world_size):
    from meshlm.comm import CommStats
    from meshlm.mesh import ParallelDims, build_mesh
    from meshlm.models.transformer import build_model
    from meshlm.parallel.data import apply_data_parallel

    mesh = build_mesh(ParallelDims(), device_type="cpu", stats=CommStats())
    out = {}
    for name, overrides in VARIANTS.items():
        cfg = ModelConfig(**BASE, **overrides)
        for bucket_mb in BUCKETS_MB:
            model = build_model(cfg, seed=0)
            dp = apply_data_parallel(model, mesh, bucket_size_mb=bucket_mb)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(0)
            seqs = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
            local = GLOBAL_BATCH // world_size
            mine = seqs[rank * local:(rank + 1) * local]
            micro = list(zip(mine[:, :-1].split(MICRO_BATCH), mine[:, 1:].split(MICRO_BATCH)))
            for i, (inputs, targets) in enumerate(micro):
                with dp.no_sync() if i < len(micro) - 1 else torch.enable_grad():
                    logits = model(inputs)
                    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / seqs[:, 1:].numel()
                    loss.backward()
            opt.step()
            params = list(model.parameters())  # tied weights once
            states = [st for st in opt.state.values()]
            out[(name, bucket_mb)] = {
                "weights": sum(p.numel() * p.element_size() for p in params),
                "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params),
                "optimizer": sum(t.numel() * t.element_size() for st in states for k, t in st.items() if k != "step"),
                "comm_buffers": sum(dp.bucket_bytes),
                "step_counters": sum(st["step"].numel() * st["step"].element_size() for st in states),
                "num_param_tensors": len(params),
                "num_buckets": len(dp.buckets),
            }
            dp.remove()
    return out


def test_predicted_model_state_equals_counted_bytes_per_rank_dp2():
    results = run_distributed(count_worker, 2, timeout=90)
    assert results[0] == results[1]  # replicas hold the same state
    counted = results[0]
    for (name, bucket_mb), got in counted.items():
        cfg = ModelConfig(**BASE, **VARIANTS[name])
        layout = Layout(dp_shard=2, zero_stage=0, micro_batch_size=MICRO_BATCH, bucket_size_mb=bucket_mb)
        est = estimate(cfg, "a100", gpus=2, layout=layout, seq_len=SEQ, global_batch_size=GLOBAL_BATCH,
                       precision="fp32")
        assert est.num_microbatches == 2
        for key in ("weights", "gradients", "optimizer", "comm_buffers"):
            predicted = est.memory_gib[key] * 2**30
            assert round(predicted) == got[key], (name, bucket_mb, key, predicted, got[key])
        assert got["step_counters"] == 4 * got["num_param_tensors"]
    # the small bucket size really made several buckets, and the buffer bytes do not depend on it
    assert counted[("gqa", BUCKETS_MB[0])]["num_buckets"] > 1 == counted[("gqa", BUCKETS_MB[1])]["num_buckets"]
