"""Planner: Mixture-of-Experts pricing -- expert tensor parallelism (ep spanning tp ranks), the overlapped
expert all-to-all, and the token dispatcher's permutation traffic. Torch-free: the planner alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshlm.config import ModelConfig
from meshlm.planner.cost import estimate, estimate_layout
from meshlm.planner.cluster import get_cluster
from meshlm.planner.cost import Job, ModelSummary
from meshlm.planner.kernels import gemms_fwd_bwd, layer_gemms, moe_dispatch_elements
from meshlm.planner.layout import Layout
from meshlm.planner.memory import rank_params
from meshlm.planner.mla import MLA, matmul_params, total_params
from meshlm.planner.placement import rank_setup

# A small fine-grained MoE (Qwen3-MoE-like shape, 8 layers): 64 experts, top-8.
MOE = ModelConfig(vocab_size=4096, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
                  intermediate_size=3072, max_seq_len=4096, num_experts=64, num_experts_per_token=8,
                  moe_intermediate_size=256)
JOB = Job(seq_len=4096, global_batch_size=64)


def _layout(**kw) -> Layout:
    base = dict(dp_shard=8, tp=2, pp=1, ep=16, micro_batch_size=1, zero_stage=1)
    return Layout(**{**base, **kw})


def test_ep_may_span_tensor_parallel_ranks_only_with_expert_tp():
    # ep=16 over dp_shard=8 x tp=2: Megatron-Core's MoE parallel folding (expert_tensor_parallel_size=1)
    with pytest.raises(ValueError, match="expert_tp=1"):
        estimate(MOE, get_cluster("h100"), JOB, _layout(), gpus=16)
    est = estimate(MOE, get_cluster("h100"), JOB, _layout(expert_tp=1), gpus=16)
    assert est.time_s["step"] > 0 and "ep16etp1" in est.layout.short()
    # meshlm's own runtime shards experts by tp: not a layout it can run
    with pytest.raises(ValueError, match="meshlm keeps experts whole on the tp ranks"):
        estimate(MOE, get_cluster("h100"), Job(seq_len=4096, global_batch_size=64, runtime="meshlm",
                                               precision="fp32"), _layout(expert_tp=1), gpus=16)
    with pytest.raises(ValueError, match="must divide tp"):
        estimate(MOE, get_cluster("h100"), JOB, _layout(ep=8, expert_tp=3), gpus=16)


def test_expert_tp_splits_experts_over_etp_ranks_with_the_same_flops():
    tokens = 4096
    folded = layer_gemms(MOE, tokens=tokens, tp=2, ep=16, moe_fraction=1.0, etp=1)
    sharded = layer_gemms(MOE, tokens=tokens, tp=2, ep=8, moe_fraction=1.0)
    flops = lambda gemms: sum(2 * m * n * k * c for m, n, k, c in gemms)  # noqa: E731
    assert flops(folded) == pytest.approx(flops(sharded))
    # the routed experts' first GEMM: full width e_inter (not e_inter / tp), the rank's tokens / tp dispatched
    rows = tokens / 2 * MOE.num_experts_per_token * 16 / MOE.num_experts
    assert (rows, 2 * MOE.moe_intermediate_size, MOE.hidden_size, 4.0) in folded
    # parameters: E / ep whole experts per rank (not E / ep experts split over tp), and the ep group's ranks
    # are contiguous (expert_tp innermost): 16 ranks over two 8-GPU domains
    summary = ModelSummary.build(MOE, JOB.seq_len)
    cluster = get_cluster("h100")
    lo1, lo0 = _layout(expert_tp=1), _layout(ep=8)
    r1, r0 = rank_setup(summary, cluster, JOB, lo1), rank_setup(summary, cluster, JOB, lo0)
    assert rank_params(summary, JOB, lo1, r1).experts == pytest.approx(8 * summary.layer_experts / 16)
    assert rank_params(summary, JOB, lo0, r0).experts == pytest.approx(8 * summary.layer_experts / (2 * 8))
    assert r1.spans["ep"] == (8, 2) and r0.spans["ep"] == (4, 2)


def test_overlapped_expert_all_to_all_is_hidden_under_the_layer_compute():
    cluster = get_cluster("h100")
    lo = _layout(expert_tp=1)
    exposed = estimate(MOE, cluster, JOB, lo, gpus=16)
    hidden = estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=64, ep_comm_overlap=True), lo, gpus=16)
    assert exposed.time_s["ep_comm"] > 0
    assert hidden.time_s["ep_comm"] < exposed.time_s["ep_comm"]
    # what the compute covers still costs the SMs the all-to-all holds
    assert hidden.time_s["ep_comm"] >= cluster.comm_sm_fraction * exposed.time_s["ep_comm"] - 1e-12
    assert hidden.time_s["compute"] == pytest.approx(exposed.time_s["compute"])
    # Megatron-Core refuses the overlap with full recomputation and with a non-interleaved pipeline
    overlap = Job(seq_len=4096, global_batch_size=64, ep_comm_overlap=True)
    with pytest.raises(ValueError, match="full"):
        estimate(MOE, cluster, overlap, _layout(expert_tp=1, recompute="full"), gpus=16)
    with pytest.raises(ValueError, match="interleaved"):
        estimate(MOE, cluster, overlap, _layout(dp_shard=4, pp=2, ep=8, expert_tp=1), gpus=16)
    estimate(MOE, cluster, overlap, _layout(dp_shard=4, pp=2, ep=8, expert_tp=1, pp_schedule="interleaved",
                                            pp_chunks=2), gpus=16)


def test_dispatch_permutations_count_each_pass():
    k, h = MOE.num_experts_per_token, MOE.hidden_size
    # permute (k h read + k h written) and unpermute (k h read, h written); no regrouping without ep
    assert moe_dispatch_elements(MOE, ep=1) == 3 * k * h + h
    # with several local experts, the rows are regrouped by local expert after the dispatch and back
    # before the combine: two more passes of k h read + k h written
    assert moe_dispatch_elements(MOE, ep=8) == 7 * k * h + h
    # one expert per rank: nothing to regroup
    assert moe_dispatch_elements(MOE, ep=MOE.num_experts) == 3 * k * h + h
    dense = ModelConfig(vocab_size=4096, hidden_size=1024, num_layers=8, num_heads=16, intermediate_size=3072)
    assert moe_dispatch_elements(dense, ep=1) == 0.0


def test_dispatch_permutations_are_priced_as_memory_traffic():
    # the same layout at ep=1 and ep=8, tp=1: the step's compute differs by the expert GEMMs' shapes (more
    # rows, fewer local experts) and by the regrouping passes' HBM time, forward + twice that backward
    cluster = get_cluster("h100")
    job = Job(seq_len=4096, global_batch_size=16)
    one = estimate(MOE, cluster, job, Layout(dp_shard=8, ep=1, micro_batch_size=1), gpus=8)
    eight = estimate(MOE, cluster, job, Layout(dp_shard=8, ep=8, micro_batch_size=1), gpus=8)
    kw = dict(rate=cluster.peak("bf16") * cluster.matmul_efficiency, hbm_bw=cluster.hbm_bw * cluster.hbm_efficiency,
              in_bytes=2, k_overhead=cluster.gemm_k_overhead)
    def gemm(ep: int) -> float:
        return sum(gemms_fwd_bwd(layer_gemms(MOE, tokens=4096, tp=1, ep=ep, moe_fraction=1.0), **kw))

    k, h = MOE.num_experts_per_token, MOE.hidden_size
    per_mb_layer = gemm(8) - gemm(1) + 4096 * 4 * k * h * 2 * 3 / kw["hbm_bw"]  # bf16, fwd + 2x bwd
    microbatches = 16 // 8
    assert eight.time_s["compute"] - one.time_s["compute"] == pytest.approx(
        microbatches * MOE.num_layers * per_mb_layer, rel=1e-6)


def test_expert_imbalance_makes_the_busiest_rank_set_the_pace():
    cluster = get_cluster("h100")
    lo = Layout(dp_shard=8, ep=8, micro_batch_size=1)
    even = estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=16), lo, gpus=8)
    skewed = estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=16, expert_imbalance=1.5), lo, gpus=8)
    assert skewed.time_s["compute"] > even.time_s["compute"]
    assert skewed.time_s["ep_comm"] > 1.4 * even.time_s["ep_comm"]  # bandwidth-bound: ~1.5x, latency unchanged
    # the routed experts' FLOPs on the busiest rank grow by the factor; attention and router do not
    flops = lambda gemms: sum(2 * m * n * k * c for m, n, k, c in gemms)  # noqa: E731
    base = layer_gemms(MOE, tokens=4096, tp=1, ep=8, moe_fraction=1.0)
    busy = layer_gemms(MOE, tokens=4096, tp=1, ep=8, moe_fraction=1.0, imbalance=1.5)
    experts = 2 * 4096 * MOE.num_experts_per_token * 3 * MOE.hidden_size * MOE.moe_intermediate_size
    assert flops(busy) - flops(base) == pytest.approx(0.5 * experts)
    # without expert parallelism every expert is local: the rank's total does not depend on the routing
    one = Layout(dp_shard=8, ep=1, micro_batch_size=1)
    local_skewed = estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=16, expert_imbalance=1.5), one, gpus=8)
    local_even = estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=16), one, gpus=8)
    assert local_skewed.time_s["step"] == pytest.approx(local_even.time_s["step"])
    with pytest.raises(ValueError, match="must be >= 1"):
        estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=16, expert_imbalance=0.5), lo, gpus=8)
    with pytest.raises(ValueError, match="exceeds ep=8"):
        estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=16, expert_imbalance=9.0), lo, gpus=8)


def test_meshlm_keeps_each_expert_whole_on_the_tp_ranks():
    """meshlm's runtime replicates the routed experts over tp (parallel/expert.py: the ep group is carved
    from dp_shard x cp at one tp coordinate), so a rank holds num_experts / ep whole experts; Megatron-Core
    with expert_tp = tp splits each over the tp ranks as well."""
    summary = ModelSummary.build(MOE, JOB.seq_len)
    lo = _layout(ep=8)
    per_rank = {}
    for runtime in ("meshlm", "megatron"):
        job = Job(seq_len=4096, global_batch_size=64, runtime=runtime, precision="fp32")
        p = rank_params(summary, job, lo, rank_setup(summary, get_cluster("h100"), job, lo))
        per_rank[runtime] = p.experts
        if runtime == "meshlm":  # ZeRO over the ranks holding the same experts: dp_shard / ep (not x tp)
            assert p.expert_shard == 8 // 8
    assert per_rank["meshlm"] == MOE.num_layers * summary.layer_experts / 8
    assert per_rank["megatron"] == per_rank["meshlm"] / 2


def test_flex_dispatcher_sends_a_token_across_once_per_node_holding_its_experts():
    """Megatron-Core's flex dispatcher (DeepEP / HybridEP): a token crosses to the other node once, whichever of its
    top-8 experts live there, and is forwarded inside it over NVLink; NCCL's all-to-all sends every routed copy.
    Over two 8-GPU nodes (ep 16, expert_tp 1) the bytes each GPU sends across fall from 8 x 8/16 = 4 copies a
    token to 1 - 2^-8 of one, so the exposed expert time falls by nearly that where the NIC bounds it."""
    from meshlm.planner.collectives import expert_all_to_all

    cluster = get_cluster("h100")
    lo = _layout(expert_tp=1)
    nccl = estimate(MOE, cluster, JOB, lo, gpus=16)
    flex = estimate(MOE, cluster, Job(seq_len=4096, global_batch_size=64, ep_dispatcher="flex"), lo, gpus=16)
    # every microbatch's layers: forward dispatch + combine and backward, each call one token's 2 x hidden x 2 bytes
    # (bf16 out and back); tokens of a microbatch on a rank: 4096 / tp (sequence parallel)
    up, out = cluster.collective_fit("all_to_all", "scale-up"), cluster.collective_fit("all_to_all", "scale-out")
    call = expert_all_to_all(2 * 4096 / 2 * MOE.hidden_size * 2, top_k=8, span=(8, 2), up=up, out=out,
                             low_latency=False)
    microbatches = 64 // 8
    assert flex.time_s["ep_comm"] == pytest.approx(microbatches * MOE.num_layers * 2 * call, rel=1e-9)
    across = 4096 / 2 * MOE.hidden_size * 2 * 2 * (1 - 0.5 ** 8) / out[1]
    assert call == pytest.approx(across + 2 * out[0], rel=1e-9)  # the NIC, not NVLink, bounds it
    # NCCL: 4 calls a layer (dispatch, combine; forward, backward) of 8 x 8/16 copies across, 15 hops' latency each;
    # flex: 2 calls of (1 - 2^-8) x (dispatch + combine): a quarter of the bytes, 2 latencies a call
    assert nccl.time_s["ep_comm"] / flex.time_s["ep_comm"] > 4 / (1 - 0.5 ** 8)
    assert flex.time_s["compute"] == pytest.approx(nccl.time_s["compute"])
    # meshlm's own expert parallelism runs NCCL's all-to-all; an unknown dispatcher is refused by name
    with pytest.raises(ValueError, match="runtime='megatron'"):
        Job(seq_len=4096, global_batch_size=64, ep_dispatcher="flex", runtime="meshlm", precision="fp32").validate()
    with pytest.raises(ValueError, match="ep_dispatcher='deepep'"):
        Job(seq_len=4096, global_batch_size=64, ep_dispatcher="deepep").validate()


def test_plan_takes_the_flex_dispatcher_from_its_flag(capsys):
    """`meshlm plan ... --ep-dispatcher flex` prices the job's expert all-to-all as the flex dispatcher sends it:
    DeepSeek-V3 with ep 64 over eight 8-GPU nodes, the same compute, less expert time, a faster step."""
    import json

    from test_planner import _cli

    argv = ["plan", "estimate", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "512", "--layout",
            "tp=2,pp=8,dp_shard=32,ep=64,expert_tp=1", "--seq-len", "4096", "--global-batch-tokens", "16M", "--json"]
    got = {}
    for name in ("alltoall", "flex"):
        rc, out = _cli(argv + ["--ep-dispatcher", name], capsys)
        assert rc == 0
        got[name] = json.loads(out)["time_s"]
    assert got["flex"]["compute"] == got["alltoall"]["compute"]
    assert got["flex"]["ep_comm"] < 0.7 * got["alltoall"]["ep_comm"] and got["flex"]["step"] < got["alltoall"]["step"]
    with pytest.raises(SystemExit):
        _cli(argv + ["--ep-dispatcher", "deepep"], capsys)


def test_deepseek_v3_trains_with_its_latent_attention_not_gqa_of_its_width():
    # The deepseek-v3 preset is meshlm's model of it: grouped-query attention of the same width (128 heads of 128).
    # A Megatron-Core job prices DeepSeek's latent attention (mla.py); meshlm's runtime the model it builds.
    cfg = ModelConfig.from_preset("deepseek-v3")
    megatron = ModelSummary.for_job(cfg, Job(seq_len=4096, global_batch_size=1024))
    own = ModelSummary.for_job(cfg, Job(seq_len=4096, global_batch_size=1024, runtime="meshlm", precision="fp32"))
    assert megatron.mla == MLA(512, 64, 1536, 128, 128) and own.mla is None

    def billions(s: ModelSummary) -> tuple[float, float]:
        L, h = cfg.num_layers, cfg.hidden_size
        dense = L * (s.layer_tp + s.layer_rep) + s.embed + s.head + h  # the final norm
        routed_active = (L - 3) * 8 * 3 * h * 2048  # 8 of 256 routed experts in the 58 MoE layers
        return (dense + L * s.layer_experts) / 1e9, (dense + routed_active) / 1e9

    # The DeepSeek-V3 report (arXiv:2412.19437): 671B parameters, 37B activated per token; GQA of its width: 688B / 55B
    total, active = billions(megatron)
    assert total == pytest.approx(671.03, abs=0.01) and active == pytest.approx(37.55, abs=0.01)
    assert billions(own) == pytest.approx((688.27, 54.79), abs=0.01)
    # what its checkpoint holds, as the failure model and `plan scale` size it
    assert total_params(cfg, "megatron") == pytest.approx(total * 1e9, rel=1e-12)
    assert total_params(cfg, "meshlm") == pytest.approx(billions(own)[0] * 1e9, rel=1e-12)
    # Per layer: down-projections h x 1536 and h x (512 + 64), whole on every tp rank (Megatron-Core's TELinear
    # 'duplicated') with the latents' norms; up-projections 1536 x 128 x 192, 512 x 128 x 256 and the output 16384 x h
    # split by heads.
    h = cfg.hidden_size
    assert megatron.layer_rep - own.layer_rep == pytest.approx(h * 1536 + h * 576 + 1536 + 512, abs=1e-6)
    assert megatron.layer_tp - own.layer_tp == pytest.approx(
        1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * h - 4 * h * 128 * 128, abs=1e-6)
    # The core: q k^T on 192 dims and p v on 128 per head, over the full square (models/stats.py's convention)
    assert megatron.flops_attn == 2 * 4096 * 128 * (192 + 128) and own.flops_attn == 4 * 4096 * 128 * 128
    assert megatron.model_flops_per_token == pytest.approx(281.15e9, rel=1e-4)
    # On a rank at tp 2: the up- and output projections on every token over half the heads, the down-projections on
    # its half of the tokens under sequence parallelism, all of them without.
    m, tokens = megatron.mla, 4096
    attention_flops = lambda gemms: sum(2 * a * b * c * n for a, b, c, n in gemms[:5])  # noqa: E731
    sp = layer_gemms(cfg, tokens=tokens, tp=2, ep=1, moe_fraction=0.0, mla=m)
    no_sp = layer_gemms(cfg, tokens=tokens, tp=2, ep=1, moe_fraction=0.0, mla=m, sequence_parallel=False)
    sharded, replicated = matmul_params(cfg, m)
    assert attention_flops(sp) == 2 * tokens * (sharded + replicated) / 2
    assert attention_flops(no_sp) == 2 * tokens * (sharded / 2 + replicated)
    # The whole estimate: less compute a step, and every rank holds fewer parameters (at tp 2, 8 stages).
    lo = Layout(dp_shard=64, tp=2, pp=8, ep=64, expert_tp=1, micro_batch_size=1, zero_stage=1)
    job = Job(seq_len=4096, global_batch_size=1024)
    cluster = get_cluster("h100")
    with_mla = estimate(cfg, cluster, job, lo, gpus=1024)
    as_gqa = estimate_layout(ModelSummary.build(cfg, 4096), cluster, job, with_mla.layout,
                             num_microbatches=with_mla.num_microbatches)
    assert with_mla.time_s["compute"] < 0.8 * as_gqa.time_s["compute"]
    assert with_mla.memory_gib["weights"] < as_gqa.memory_gib["weights"]


# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), the keys the planner reads.
DEEPSEEK_V3_JSON = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "max_position_embeddings": 163840, "n_group": 8, "topk_group": 4}


def test_a_deepseek_config_json_is_planned_with_its_latent_attention(tmp_path, capsys):
    import json

    from test_planner import _cli

    from meshlm.planner.inputs import resolve_model
    from meshlm.planner.mla import LatentConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_JSON))
    cfg = resolve_model(str(path))  # meshlm's model builds no deepseek_v3: the planner reads it as serving does
    assert isinstance(cfg, LatentConfig) and cfg.mla == MLA(512, 64, 1536, 128, 128) and cfg.preset is None
    assert resolve_model(str(tmp_path)).mla == cfg.mla  # the directory holding it
    argv = ["plan", "estimate", "--cluster", "h100", "--gpus", "1024", "--seq-len", "4096", "--global-batch-size",
            "1024", "--layout", "tp=2,pp=8,ep=64,expert_tp=1,zero_stage=1", "--json"]
    rc, from_json = _cli(argv + ["--model", str(path)], capsys)
    assert rc == 0
    _, from_preset = _cli(argv + ["--model", "deepseek-v3"], capsys)
    assert json.loads(from_json) == json.loads(from_preset)  # the same model, priced the same
    from test_planner_serving_window import GPT_OSS_120B

    (tmp_path / "oss.json").write_text(json.dumps(GPT_OSS_120B))  # read by its shapes too, without a latent attention
    oss = resolve_model(str(tmp_path / "oss.json"))
    assert not isinstance(oss, LatentConfig) and (oss.num_experts, oss.head_dim, oss.attention_bias) == (128, 64, True)
    with pytest.raises(ValueError, match="--runtime megatron"):  # meshlm's runtime cannot build it
        _cli(["plan", "estimate", "--model", str(path), "--cluster", "h100", "--gpus", "1024", "--seq-len", "4096",
              "--global-batch-size", "1024", "--layout", "tp=2,pp=8,ep=64,zero_stage=1", "--runtime", "meshlm",
              "--precision", "fp32"], capsys)


def test_recomputing_mla_up_projections_keeps_the_latents_not_the_heads(capsys):
    """Megatron-Core's recompute_modules mla_up_proj (`Job.recompute_mla_up_proj`): DeepSeek-V3's layers keep the
    attention output of their 128 heads but not q (192 per head), k (192) or v (128), and the backward runs the two
    up-projections again (1536 -> 128 x 192 and 512 -> 128 x 256)."""
    import json

    from test_planner import _cli

    from meshlm.planner.kernels import gemm_time
    from meshlm.planner.memory import layer_activation_bytes
    from meshlm.planner.published import job_of
    from meshlm.planner.timing import layer_compute

    cfg, cluster = ModelConfig.from_preset("deepseek-v3"), get_cluster("h100")
    lo = Layout(dp_shard=64, tp=2, pp=8, ep=64, expert_tp=1, micro_batch_size=1, zero_stage=1)
    kept, rebuilt = Job(seq_len=4096, global_batch_size=1024), Job(seq_len=4096, global_batch_size=1024,
                                                                    recompute_mla_up_proj=True)
    s_kept, s_rebuilt = ModelSummary.for_job(cfg, kept), ModelSummary.for_job(cfg, rebuilt)
    heads_elems = 128 * (192 + 192 + 128)  # q, k, v of every head, per token and layer
    for rc in ("none", "selective"):
        assert s_kept.act_tp[rc] - s_rebuilt.act_tp[rc] == heads_elems
        assert s_kept.act_seq[rc] == s_rebuilt.act_seq[rc]  # the latents, the up-projections' inputs, stay
        # a microbatch of 4096 tokens at tp 2 (the heads split), 2 bytes each
        assert (layer_activation_bytes(s_kept, kept, replace(lo, recompute=rc))
                - layer_activation_bytes(s_rebuilt, rebuilt, replace(lo, recompute=rc))) == 4096 * heads_elems / 2 * 2
    assert s_kept.act_tp["full"] == s_rebuilt.act_tp["full"]  # a layer recomputed whole keeps its input only
    assert s_rebuilt.hw_flops_per_token["none"] - s_kept.hw_flops_per_token["none"] == pytest.approx(
        61 * 2 * (1536 * 128 * 192 + 512 * 128 * 256), rel=1e-12)
    # The re-run: the two GEMMs over the microbatch's 4096 tokens on half the heads, at the rank's bf16 GEMM rate
    r = rank_setup(s_rebuilt, cluster, rebuilt, lo)
    layer = layer_compute(s_rebuilt, rebuilt, lo, r, imbalance=1.0)
    kw = dict(rate=r.peak * cluster.matmul_rate("bf16") / cluster.peak("bf16"), hbm_bw=r.hbm_bw, in_bytes=2,
              k_overhead=cluster.gemm_k_overhead)
    assert layer.up_proj == pytest.approx(gemm_time(4096, 64 * 192, 1536, **kw) + gemm_time(4096, 64 * 256, 512, **kw),
                                          rel=1e-12)
    assert layer.recompute("none") == layer.up_proj and layer.recompute("full") == layer.fwd
    assert layer_compute(s_kept, kept, lo, r, imbalance=1.0).recompute("none") == 0.0
    with_kept = estimate(cfg, cluster, kept, lo, gpus=1024)
    with_rebuilt = estimate(cfg, cluster, rebuilt, lo, gpus=1024)
    assert with_rebuilt.memory_gib["activations"] < with_kept.memory_gib["activations"]
    assert with_rebuilt.time_s["recompute"] > with_kept.time_s["recompute"] == 0.0
    # NVIDIA's DeepSeek-V3 recipes that set it now fit their GPUs (group AL's card on 1,024 H100s; the 25.09 run)
    from meshlm.planner.published import predict_row, read_runs

    csv = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "published_runs_dev.csv"
    rows = {r["row_id"]: r for r in read_runs(csv)}
    assert job_of(rows["R608"], cfg).recompute_mla_up_proj and job_of(rows["R078"], cfg).recompute_mla_up_proj
    assert not job_of(rows["R610"], cfg).recompute_mla_up_proj  # its recompute_modules list is empty
    assert all(predict_row(rows[i])["fits"] for i in ("R078", "R608", "R609"))
    with pytest.raises(ValueError, match="runtime='megatron'"):
        Job(seq_len=4096, global_batch_size=8, runtime="meshlm", precision="fp32", recompute_mla_up_proj=True).validate()
    argv = ["plan", "estimate", "--cluster", "h100", "--gpus", "1024", "--seq-len", "4096", "--global-batch-size",
            "1024", "--layout", "tp=2,pp=8,ep=64,expert_tp=1,zero_stage=1,micro_batch_size=1", "--json"]
    _, plain = _cli(argv + ["--model", "deepseek-v3"], capsys)
    _, flagged = _cli(argv + ["--model", "deepseek-v3", "--recompute-mla-up-proj"], capsys)
    assert json.loads(flagged)["memory_gib"]["activations"] < json.loads(plain)["memory_gib"]["activations"]
    with pytest.raises(ValueError, match="grouped-query attention"):
        _cli(argv + ["--model", "llama3-8b", "--recompute-mla-up-proj"], capsys)


def test_group_limited_routing_sends_a_token_to_fewer_nodes(tmp_path):
    """DeepSeek-V3's router takes a token's 8 experts from the best 4 of 8 groups of 32 (config.json n_group 8,
    topk_group 4): over expert-parallel ranks holding the experts in order, its copies reach at most the nodes those
    groups lie on, which the flex dispatcher's cross-node sends (`collectives.expert_all_to_all`, normal kernels)
    count once each."""
    import json
    import random

    from meshlm.planner.collectives import expert_all_to_all, other_nodes_reached
    from meshlm.planner.inputs import resolve_model
    from meshlm.planner.mla import router_groups

    for n in (2, 4, 8, 16):  # uniform routing: each of the other n - 1 nodes holds one of the 8 with 1 - (1 - 1/n)^8
        assert other_nodes_reached(n, 8) == pytest.approx((n - 1) * (1 - (1 - 1 / n) ** 8), rel=1e-12)
    assert other_nodes_reached(8, 8, (8, 4)) == pytest.approx(4 * 7 / 8)  # a group a node: the 4 chosen, less its own

    def simulated(n_out: int, trials: int = 3000) -> float:
        """DeepSeek-V3's group-limited top-k on random scores (forced balancing's random logits): each group scored
        by the sum of its top two, the best four kept, the top eight experts among them; 256 experts in order on
        n_out nodes, the token's own node drawn uniformly."""
        rng, per_node, hits = random.Random(7), 256 // n_out, 0
        for _ in range(trials):
            s = [rng.random() for _ in range(256)]
            best = sorted(range(8), key=lambda g: -sum(sorted(s[32 * g:32 * g + 32])[-2:]))[:4]
            top = sorted((e for g in best for e in range(32 * g, 32 * g + 32)), key=lambda e: -s[e])[:8]
            hits += len({e // per_node for e in top} - {rng.randrange(n_out)})
        return hits / trials

    for n in (2, 4, 8, 16):
        assert other_nodes_reached(n, 8, (8, 4)) == pytest.approx(simulated(n), rel=0.06)
    deepseek = ModelConfig.from_preset("deepseek-v3")
    assert router_groups(deepseek) == (8, 4) and router_groups(ModelConfig.from_preset("llama3-8b")) == (1, 1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_JSON))
    assert router_groups(resolve_model(str(path))) == (8, 4)
    # One MoE layer's dispatch + combine over 64 GPUs on 8 nodes: the node-crossing part shrinks by 3.5 / 4.6
    fits = dict(top_k=8, span=(8, 8), up=(2e-6, 300e9), out=(5e-6, 40e9), low_latency=False)
    unlimited, limited = expert_all_to_all(1e9, **fits), expert_all_to_all(1e9, **fits, groups=(8, 4))
    assert limited - 2 * 5e-6 == pytest.approx((unlimited - 2 * 5e-6) * 3.5 / other_nodes_reached(8, 8), rel=1e-12)
    # a low-latency kernel sends every copy on its own: as many leave the node either way
    assert (expert_all_to_all(1e9, **{**fits, "low_latency": True}, groups=(8, 4))
            == expert_all_to_all(1e9, **{**fits, "low_latency": True}))


def test_a_windowed_config_of_a_billion_layers_is_refused_before_its_windows_are_listed(tmp_path):
    """The serving planner lists a sliding-window model's windows layer by layer (`layer_windows`) before any other
    reading: the layer cap is on the one config.json reader, so that path is refused too instead of hanging."""
    import json

    from meshlm.planner.serving_model import served_model

    hf = {"model_type": "mistral", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 10**9,
          "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128, "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="1,000,000,000 layers; the planner prices at most"):
        served_model(str(tmp_path / "config.json"))


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_a_config_of_a_billion_layers_is_refused_not_walked(tmp_path, kind):
    """Found by fuzzing: every plan command walked each layer of a config.json's num_hidden_layers=1e9 for ever."""
    import json

    from meshlm.config import ModelConfig
    from meshlm.planner.inputs import resolve_model
    from meshlm.planner.serving_model import MAX_LAYERS

    hf = dict(DEEPSEEK_V3_JSON) if kind == "deepseek" else ModelConfig.from_preset("llama3-8b").to_hf_dict()
    hf["num_hidden_layers"] = 10**9
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"1,000,000,000 layers; the planner prices at most {MAX_LAYERS:,}"):
        resolve_model(str(tmp_path / "config.json"))
    hf["num_hidden_layers"] = MAX_LAYERS
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert resolve_model(str(tmp_path / "config.json")).num_layers == MAX_LAYERS
