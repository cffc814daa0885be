"""The Trainer under expert parallelism reproduces the single-process dropless MoE, alone and with data
parallelism (plain and hybrid, ZeRO-1/2/3: the experts sharded over the ranks holding the same ones), tensor
parallelism (with and without SP), context parallelism, pipeline parallelism (every schedule; MoE models under pp too), with a
capacity factor and with aux-loss-free balancing; layouts that
cannot run yet are refused before any work.

Parity goes through `meshlm verify` (ranks started by the test harness): fp64 runs match the one-process
fp64 run to FP64_TOL in losses, grad norms and every final weight (the checkpoint gathers the experts
over "ep", so it holds the reference layout). The tokens per expert are uneven in every run (asserted on
the logged expert load), and the "ep" axis moves exactly the all-to-all volume every step.
"""

import io
from functools import partial

import pytest

from dist import run_distributed
from meshlm import verify
from meshlm.config import load_config
from meshlm.parallel.parallelize import check_layout
from parity import FP64_TOL
from runs import SMALL_MODEL, TRAIN, harness_launch, rows, train_config

STEPS = 5
# 4 experts, top-2, every layer MoE, a shared expert; a large aux coefficient so a mis-scaled
# load-balancing loss would move the routers visibly. Micro-batches of 2 sequences of 32 tokens.
MOE = ["model.num_experts=4", "model.num_experts_per_token=2", "model.moe_intermediate_size=32",
       "model.num_shared_experts=1", "model.router_aux_loss_coef=0.5"]
SETTINGS = [*TRAIN, *MOE, "train.global_batch_size=8", "train.micro_batch_size=2", "train.lr=3e-3",
            "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, None, settings=SETTINGS)


LAYOUTS = {  # id: (ranks, settings, axes that must have moved bytes)
    "ep2": (2, ["parallel.ep=2"], {"ep", "dp"}),  # dp=2: every rank its own experts
    "ep4": (4, ["parallel.ep=4"], {"ep", "dp"}),
    "ep2xdp_shard4": (4, ["parallel.ep=2"], {"ep", "ep_dp", "dp"}),  # two ep groups: experts reduced over ep_dp
    "hybrid_ep2": (4, ["parallel.ep=2", "parallel.dp_replicate=2"], {"ep", "ep_dp", "dp"}),
    "ep2xzero1": (2, ["parallel.ep=2", "parallel.zero_stage=1"], {"ep", "dp_shard"}),
    "ep2xzero2xdp_shard4": (4, ["parallel.ep=2", "parallel.zero_stage=2"], {"ep", "ep_dp", "dp_shard"}),
    "hybrid_ep2xzero2": (4, ["parallel.ep=2", "parallel.zero_stage=2", "parallel.dp_replicate=2"],
                         {"ep", "ep_dp", "dp_shard", "dp_replicate"}),
    # ZeRO-3: the dense parameters of each block (and the root: embedding, norm, head) gathered over
    # dp_shard, the block's experts over ep_dp (size 1 on 2 ranks: nothing to gather); hybrid with a
    # dense first block, which the experts' sharding has no unit for
    "ep2xzero3": (2, ["parallel.ep=2", "parallel.zero_stage=3"], {"ep", "dp_shard"}),
    "ep2xzero3xdp_shard4": (4, ["parallel.ep=2", "parallel.zero_stage=3"], {"ep", "ep_dp", "dp_shard"}),
    "hybrid_ep2xzero3_dense_first": (4, ["parallel.ep=2", "parallel.zero_stage=3", "parallel.dp_replicate=2",
                                         "model.first_dense_layers=1"], {"ep", "ep_dp", "dp_shard", "dp_replicate"}),
    "ep2xzero3_recompute": (2, ["parallel.ep=2", "parallel.zero_stage=3", "parallel.recompute=full"],
                            {"ep", "dp_shard"}),
    # tensor parallelism without SP: attention and dense layers split over tp, MoE layers whole on the tp
    # ranks (the experts split over ep)
    "tp2_moe": (2, ["parallel.tp=2", "parallel.sequence_parallel=false"], {"tp"}),
    "ep2xtp2": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=false"], {"ep", "dp", "tp"}),
    "ep2xtp2xzero2": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=false",
                          "parallel.zero_stage=2"], {"ep", "dp_shard", "tp"}),
    "ep2xtp2xzero3": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=false",
                          "parallel.zero_stage=3"], {"ep", "dp_shard", "tp"}),
    # tensor parallelism with SP: each tp rank's MoE layers route its chunk of the sequence (no gather),
    # their gradients summed over tp, the load-balancing counts over tp
    "ep2xtp2_sp": (4, ["parallel.ep=2", "parallel.tp=2"], {"ep", "dp", "tp"}),
    "ep2xtp2_spxzero3": (8, ["parallel.ep=2", "parallel.tp=2", "parallel.zero_stage=3"],
                         {"ep", "ep_dp", "dp_shard", "tp"}),
    # context parallelism: the counts summed over cp too; ep carved from dp_shard x cp
    "cp2xep2": (4, ["parallel.cp=2", "parallel.ep=2"], {"ep", "cp", "dp_cp"}),
    "cp2xtp2xep2": (8, ["parallel.cp=2", "parallel.tp=2", "parallel.ep=2"], {"ep", "cp", "tp", "dp_cp"}),
    "cp2_ulyssesxep2": (4, ["parallel.cp=2", "parallel.cp_method=ulysses", "parallel.ep=2"], {"ep", "cp", "dp_cp"}),
    "cp4_hybridxep2": (4, ["parallel.cp=4", "parallel.cp_ulysses=2", "parallel.ep=2"],
                       {"ep", "cp_ulysses", "cp_ring", "dp_cp"}),
    "cp2xtp2_bias": (4, ["parallel.cp=2", "parallel.tp=2", "model.router_bias_update_rate=0.01"], {"cp", "tp"}),
    # pipeline parallelism: each stage adds its MoE layers' load-balancing losses to its own backward
    "pp2_moe_1f1b": (2, ["parallel.pp=2"], {"pp"}),
    "pp2_moe_zero_bubble": (2, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble"], {"pp"}),
    "pp2_moe_interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_chunks=2",
                                "model.num_layers=4"], {"pp"}),
    "ep2xpp2": (4, ["parallel.ep=2", "parallel.pp=2"], {"ep", "dp", "pp"}),
    "ep2xpp2xzero3": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=3"], {"ep", "dp_shard", "pp"}),
    "ep2xpp2xzero1": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=1"], {"ep", "dp_shard", "pp"}),
    # micro_batch_size=0 (each rank's whole batch at once): verify gives the reference the same micro-batches,
    # since the load-balancing loss is a mean over each micro-batch's tokens
    "ep2_whole_batch": (2, ["parallel.ep=2", "train.micro_batch_size=0"], {"ep", "dp"}),
    "ep2_capacity": (2, ["parallel.ep=2", "model.capacity_factor=1.0"], {"ep", "dp"}),
    "ep2_bias": (2, ["parallel.ep=2", "model.router_bias_update_rate=0.01"], {"ep", "dp"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_the_single_process_run_in_fp64(tmp_path, text_file, layout):
    nproc, settings, axes = LAYOUTS[layout]
    report = verify.run(make_cfg(text_file, *settings), nproc=nproc, steps=STEPS, run_dir=tmp_path,
                        launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL
    assert axes <= set(report.comm_bytes), report.comm_bytes
    logged = [r["expert_load"] for r in rows(tmp_path / "layout") if "expert_load" in r]
    assert len(logged) == STEPS and all(e["min"] < e["max"] for e in logged), logged  # uneven splits
    if "capacity" in layout:
        assert sum(e["dropped"] for e in logged) > 0, logged
    if layout == "ep2":
        # the inference engine runs the checkpoint saved under ep (full experts) as the reference's
        from meshlm.infer import LLM, SamplingParams

        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        outputs = [LLM(tmp_path / run, device="cpu").generate([[1, 2, 3, 4]], greedy)[0].token_ids
                   for run in ("layout", "reference")]
        assert outputs[0] == outputs[1], outputs


def test_layouts_that_cannot_run_yet_are_refused(text_file):
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        check_layout(load_config(overrides=[*SMALL_MODEL, "train.seq_len=32", f"data.path={text_file}", "parallel.ep=2"]), 2)
    with pytest.raises(ValueError, match=r"parallel.ep=3 does not divide model.num_experts=4.*\{1,2,4\}"):
        check_layout(make_cfg(text_file, "parallel.ep=3", "train.global_batch_size=6"), 3)
    with pytest.raises(ValueError, match=r"capacity_factor=1.0 with tensor parallelism.*capacity_factor=0"):
        check_layout(make_cfg(text_file, "parallel.ep=2", "parallel.tp=2", "model.capacity_factor=1.0"), 4)
    with pytest.raises(ValueError, match=r"capacity_factor=1.0 with parallel.cp=2.*capacity_factor=0"):
        check_layout(make_cfg(text_file, "parallel.cp=2", "model.capacity_factor=1.0"), 2)
    # pp x ZeRO-3 runs (ep2xpp2xzero3 above)
    assert check_layout(make_cfg(text_file, "parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=3"), 4).pp == 2
    with pytest.raises(ValueError, match="ep=2 does not divide dp_shard x cp"):
        check_layout(make_cfg(text_file, "parallel.ep=2", "parallel.dp_replicate=2"), 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_saved_under_ep_x_zero_resumes_in_one_process(tmp_path, text_file, stage):
    """The checkpoint holds the reference layout (experts gathered over "ep", their ZeRO moments over
    "ep_dp"): one process resumes it and continues as the uninterrupted one-process run does."""
    from meshlm.train.trainer import Trainer

    steps = ["train.steps=4", "train.precision=fp64", "train.val_batches=0", "train.sample_tokens=0",
             "train.progress=false"]
    saved = make_cfg(text_file, *steps, "parallel.ep=2", f"parallel.zero_stage={stage}",
                     f"train.run_dir={tmp_path / 'ep'}")
    run_distributed(train_until, 2, saved, 2)
    resumed = make_cfg(text_file, *steps, f"train.run_dir={tmp_path / 'ep'}")
    Trainer(resumed, resume=True).train()
    Trainer(make_cfg(text_file, *steps, f"train.run_dir={tmp_path / 'one'}")).train()
    got, want = [r["loss"] for r in rows(tmp_path / "ep") if "loss" in r], [r["loss"] for r in rows(tmp_path / "one")
                                                                          if "loss" in r]
    assert len(got) == len(want) == 4
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= FP64_TOL, (got, want)


def train_until(rank, world_size, cfg, step):
    from meshlm.train.trainer import Trainer

    Trainer(cfg).train(until_step=step)


# The model as shipped: the `tiny-moe` preset (8 experts top-2, a shared expert, a dense first layer).
PRESET = ["model.preset=tiny-moe", "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
          "train.lr=3e-3", "train.warmup_steps=2", "train.device=cpu", "data.val_fraction=0.1",
          "parallel.bucket_size_mb=0.05"]


@pytest.mark.parametrize("ep", [2, 4])
def test_the_tiny_moe_preset_under_ep_matches_one_process(tmp_path, text_file, ep):
    cfg = load_config(overrides=[*PRESET, f"data.path={text_file}", f"parallel.ep={ep}"])
    report = verify.run(cfg, nproc=ep, steps=STEPS, run_dir=tmp_path, launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL
    logged = [r["expert_load"] for r in rows(tmp_path / "layout") if "expert_load" in r]
    assert len(logged) == STEPS and all(e["min"] < e["max"] for e in logged), logged
