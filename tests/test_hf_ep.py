"""Hugging Face MoE checkpoints under expert parallelism give transformers' logits.

Tiny random Mixtral, Qwen3-MoE and Qwen2-MoE (shared expert with its gate, a leading dense layer)
models are built with transformers, saved with its own save_pretrained and loaded with
`meshlm.models.hf.load_pretrained` on 2 gloo ranks; the experts are then spread over ep=2 in the two
ways meshlm offers -- `expert_mesh` + `apply_expert_parallel` by hand, and `parallelize` with
ParallelConfig(ep=2), as the trainer does -- on the mesh of ParallelDims(dp_shard=2, ep=2). Each rank
feeds its OWN tokens (a different batch size and length per rank, so the all-to-all splits are
uneven) and its logits must match transformers' logits on those tokens to 1e-4 in fp32. Each rank
must also hold only its half of the experts, and the "ep" axis must have moved bytes.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from dist import run_distributed  # noqa: E402
from meshlm.comm_stats import CommStats  # noqa: E402
from meshlm.config import ParallelConfig  # noqa: E402
from meshlm.mesh import ParallelDims, build_mesh  # noqa: E402
from meshlm.models.hf import load_pretrained  # noqa: E402
from meshlm.parallel.expert import apply_expert_parallel, expert_mesh  # noqa: E402
from meshlm.parallel.parallelize import parallelize  # noqa: E402
from runs import randomize_weights

VOCAB, NUM_EXPERTS, EP = 128, 4, 2
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, intermediate_size=96, max_position_embeddings=128, attn_implementation="eager")
ARCHS = {
    "mixtral": ("mixtral", dict(num_local_experts=NUM_EXPERTS, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=NUM_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=NUM_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[0])),
}
SHAPES = [(2, 12), (3, 7)]  # (sequences, tokens) fed by rank 0 and rank 1
TOL = 1e-4



def _tokens(rank: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, SHAPES[rank], generator=torch.Generator().manual_seed(1000 * seed + rank))


def _rank_logits(rank, world_size, path, seed):
    """On each rank: this rank's logits under both ep transforms, its expert counts, the ep bytes."""
    tokens = _tokens(rank, seed)
    dims = ParallelDims(dp_shard=world_size, ep=EP)

    stats = CommStats()
    mesh = expert_mesh(build_mesh(dims, device_type="cpu", stats=stats), EP)
    by_hand = apply_expert_parallel(load_pretrained(path).eval(), mesh)
    with torch.no_grad():
        logits_by_hand = by_hand(tokens)
    ep_bytes = stats.total(op="all_to_all", axis="ep").bytes

    wrapped = parallelize(load_pretrained(path).eval(), build_mesh(dims, device_type="cpu"),
                          ParallelConfig(dp_shard=world_size, ep=EP))
    with torch.no_grad():
        logits_parallelize = wrapped.module(tokens)

    local_experts = {name: p.shape[0] for name, p in by_hand.named_parameters() if ".experts." in name}
    return {"by_hand": logits_by_hand, "parallelize": logits_parallelize, "local_experts": local_experts,
            "ep_bytes": ep_bytes, "expert_parallel": wrapped.expert_parallel,
            "mesh_ep": wrapped.mesh.size("ep")}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_moe_under_ep2_matches_transformers(arch, tmp_path):
    model_type, extra = ARCHS[arch]
    seed = list(ARCHS).index(arch)
    config = transformers.AutoConfig.for_model(model_type, **TINY, **extra)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_weights(hf, seed)
    hf.eval().save_pretrained(tmp_path)

    results = run_distributed(_rank_logits, 2, tmp_path, seed, timeout=120)

    for rank, out in enumerate(results):
        with torch.no_grad():
            expected = hf(_tokens(rank, seed)).logits
        assert out["by_hand"].shape == expected.shape == (*SHAPES[rank], VOCAB)
        for way in ("by_hand", "parallelize"):
            diff = (out[way] - expected).abs().max().item()
            assert diff <= TOL, f"{arch} rank {rank} via {way}: max |logits - transformers| = {diff:.3g}"
        assert out["local_experts"] and set(out["local_experts"].values()) == {NUM_EXPERTS // EP}, out
        assert out["ep_bytes"] > 0
        assert out["expert_parallel"] and out["mesh_ep"] == EP
    # The ranks saw different tokens, so a rank that silently ran another rank's batch would show here.
    assert not torch.equal(results[0]["by_hand"][:, :7], results[1]["by_hand"][:2, :7])
