"""The Trainer under context parallelism reproduces the single-process run, alone and composed with data
parallelism, ZeRO, tensor (+ sequence) parallelism, pipeline parallelism and recomputation, with both
`parallel.cp_method`s; layouts that cannot run are refused before any work.

Parity goes through `meshlm verify` (its ranks started by the test harness): fp64 runs must match the
single-process fp64 run to FP64_TOL in losses, grad norms and every final weight; one fp32 run checks
losses and grad norms to FP32_REL. Every run also checks that the cp axis moved bytes.
"""

import io
import math
from functools import partial

import pytest

from meshlm import verify
from meshlm.parallel.parallelize import check_layout
from parity import FP32_REL, FP64_TOL
from runs import TRAIN, harness_launch, train_config

STEPS = 5
# seq 32: chunks of 4 tokens at cp=4, 8 at cp=2; micro-batches of 2 so dp=2 accumulates too.
SETTINGS = [*TRAIN, "train.global_batch_size=8", "train.micro_batch_size=2", "train.lr=3e-3",
            "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, None, settings=SETTINGS)


LAYOUTS = {  # id: (ranks, settings, axes that must have moved bytes)
    "cp2": (2, ["parallel.cp=2"], {"cp", "dp_cp"}),
    "cp4": (4, ["parallel.cp=4"], {"cp", "dp_cp"}),
    "cp2xdp2": (4, ["parallel.cp=2"], {"cp", "dp_cp"}),
    "cp2xtp2": (4, ["parallel.cp=2", "parallel.tp=2"], {"cp", "dp_cp", "tp"}),
    "cp2xzero3": (4, ["parallel.cp=2", "parallel.zero_stage=3"], {"cp", "dp_shard_cp"}),
    "cp2xtp2xdp2": (8, ["parallel.cp=2", "parallel.tp=2"], {"cp", "dp_cp", "tp"}),
}


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_the_single_process_run_in_fp64(tmp_path, text_file, layout, method):
    nproc, settings, axes = LAYOUTS[layout]
    cfg = make_cfg(text_file, *settings, f"parallel.cp_method={method}")
    report = verify.run(cfg, nproc=nproc, steps=STEPS, run_dir=tmp_path, launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL
    assert axes <= set(report.comm_bytes), report.comm_bytes
    # The cp axis moves exactly the analytic volume, every step (send and receive both counted for the
    # ring): per layer and micro-batch, with B the bytes of one rank's K (or V) block,
    #   ring       forward (cp-1) x (K+V) out and in; backward (cp-1) x (K+V + dK+dV) out and in
    #   allgather  forward one all-gather of cp x (K+V); backward one reduce-scatter of the same
    cp = int(next(s for s in settings if s.startswith("parallel.cp=")).split("=")[1])
    tp = int(next((s for s in settings if s.startswith("parallel.tp=")), "=1").split("=")[1])
    micro_batches = 8 // (2 * (nproc // (cp * tp)))  # global batch / (micro-batch x dp)
    block = 2 * (2 // tp) * (32 // cp) * 8 * 8  # micro-batch x kv heads on this rank x seq / cp x head_dim x fp64
    per_layer = 2 * (cp - 1) * (2 * block + 4 * block) if method == "ring" else cp * 2 * block * 2
    assert {r.comm_bytes["cp"] for r in report.rows} == {2 * micro_batches * per_layer}


# Ulysses, each launch covering one composition (recomputation rides along with two of them).
ULYSSES = {  # id: (ranks, settings)
    "cp2": (2, ["parallel.cp=2"]),
    "cp4_full": (4, ["parallel.cp=4", "parallel.recompute=full"]),
    "cp2xtp2_selective": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.recompute=selective"]),
    "cp2xpp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
    "cp2xzero3": (4, ["parallel.cp=2", "parallel.zero_stage=3"]),
}


@pytest.mark.parametrize("layout", list(ULYSSES))
def test_ulysses_layouts_match_the_single_process_run_in_fp64(tmp_path, text_file, layout):
    nproc, settings = ULYSSES[layout]
    cfg = make_cfg(text_file, *settings, "parallel.cp_method=ulysses")
    report = verify.run(cfg, nproc=nproc, steps=3, run_dir=tmp_path, launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL
    # Exact bytes on "cp" (parallel/context.py's docstring): per layer and micro-batch, with one head of this
    # rank's tokens H = micro-batch x seq / cp x head_dim x fp64, h the query heads of a tp rank and g its kv
    # heads replicated to lcm(kv, cp): forward all-to-alls of H (h + 2g) and H h, backward the same; recompute
    # runs q, k, v's again (selective: the output's is not, nothing after it in the core is kept) or both (full).
    cp, tp, pp, rc = cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.recompute
    dp = nproc // (cp * tp * pp)
    micro_batches, layers = 8 // (2 * dp), 2 // pp
    head = 2 * (32 // cp) * 8 * 8
    h, g = 4 // tp, math.lcm(2 // tp, cp)
    qkv, out = head * (h + 2 * g), head * h
    per_layer = 2 * (qkv + out) + {"none": 0, "selective": qkv, "full": qkv + out}[rc]
    assert {r.comm_bytes["cp"] for r in report.rows} == {layers * micro_batches * per_layer}


def test_hybrid_cp4_with_ulysses_pairs_matches_the_single_process_run_in_fp64(tmp_path, text_file):
    cfg = make_cfg(text_file, "parallel.cp=4", "parallel.cp_ulysses=2")
    report = verify.run(cfg, nproc=4, steps=3, run_dir=tmp_path, launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL
    # Per layer and micro-batch (4 micro-batches, 2 layers), with one head of this rank's tokens H = 2 x 8 x 8
    # x fp64 and g = lcm(2 kv heads, 2) = 2: over the pair, all-to-alls of H (4 + 2g) and H 4, forward and
    # backward; round the ring of 2 pairs, one step of the pair's K+V (g / 2 kv heads of 16 tokens: H g each)
    # forward, K+V and dK+dV backward, sent and received.
    head, g = 2 * 8 * 8 * 8, 2
    a2a = 2 * (head * (4 + 2 * g) + head * 4)
    ring = 2 * (2 * head * g + 4 * head * g)
    assert {r.comm_bytes["cp_ulysses"] for r in report.rows} == {2 * 4 * a2a}
    assert {r.comm_bytes["cp_ring"] for r in report.rows} == {2 * 4 * ring}


@pytest.mark.parametrize("layout", [
    ["parallel.zero_stage=1"], ["parallel.zero_stage=2", "parallel.dp_replicate=2"],
    ["parallel.pp=2"], ["parallel.recompute=selective"], ["parallel.recompute=full"],
], ids=["zero1", "zero2_hybrid", "pp2", "selective", "full"])
def test_cp2_composes_with(tmp_path, text_file, layout):
    nproc = 4 if ("parallel.pp=2" in layout or "parallel.dp_replicate=2" in layout) else 2
    cfg = make_cfg(text_file, "parallel.cp=2", *layout)
    report = verify.run(cfg, nproc=nproc, steps=3, run_dir=tmp_path, launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL


def test_fp32_losses_and_grad_norms(tmp_path, text_file):
    report = verify.run(make_cfg(text_file, "parallel.cp=2"), nproc=2, steps=STEPS, run_dir=tmp_path,
                        launch=harness_launch, log=io.StringIO(), precision="fp32")
    assert report.ok, verify.format_report(report)
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP32_REL, verify.format_report(report)


@pytest.mark.parametrize("settings, world, match", [
    (["parallel.cp=2", "train.seq_len=30"], 2, "multiple of 4"),
    (["parallel.cp=2", "parallel.tp=4", "model.num_kv_heads=4", "train.seq_len=36"], 8, "multiple of 8"),
    (["parallel.cp=2", "model.preset=tiny-moe", "model.capacity_factor=1.0"], 2, "capacity_factor=0"),
    (["parallel.cp=3"], 4, "cp"),
    (["parallel.cp=2", "parallel.tp=4", "model.num_kv_heads=4", "parallel.cp_method=ulysses"], 8,
     r"cp=2 with model.num_heads=4 / parallel.tp=4 = 1 per tp rank: the heads are not divisible by 2"),
    (["parallel.cp=2", "parallel.cp_method=alltoall"], 2, r"\['ring', 'allgather', 'ulysses'\]"),
    (["parallel.cp=4", "parallel.cp_ulysses=3"], 4, r"cp_ulysses=3 does not divide parallel.cp=4.*\{1,2,4\}"),
    (["parallel.cp=4", "parallel.cp_ulysses=2", "parallel.cp_method=allgather"], 4, "set parallel.cp_method=ring"),
    (["parallel.cp=4", "parallel.cp_ulysses=4", "model.num_heads=6", "model.num_kv_heads=2",
      "model.hidden_size=48"], 4, r"cp_ulysses=4 with model.num_heads=6: .* choose parallel.cp_ulysses in \{2,3,6\}"),
])
def test_layouts_that_cannot_run_are_refused(text_file, settings, world, match):
    with pytest.raises(ValueError, match=match):
        check_layout(make_cfg(text_file, *settings), world)
