"""The Trainer under data parallelism reproduces the single-process Trainer, resumes bit-identically,
logs its communication per axis, and `parallelize` / `check_layout` refuse what cannot run.

Parity (tests/parity.py): a configuration run with train.precision=fp64 matches the fp64
single-process run in losses, grad norms, validation losses and every weight to FP64_TOL; one run
in fp32 (the real dtype) in losses, grad norms and validation losses to FP32_REL. Each world size
runs one configuration in each precision.

One launch per world size keeps this file fast: each rank trains every configuration in turn.
"""

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from meshlm.config import load_config
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.parallel.parallelize import check_layout, parallelize
from meshlm.checkpoint import latest_checkpoint
from meshlm.train.trainer import Trainer
from parity import FP32_REL, FP64_TOL, assert_close_seq, assert_state_close
from runs import TRAIN, grad_norms, rows, step_losses, train_config, val_losses, weights

STEPS = 10
PARITY_STEPS = 5
GLOBAL_BATCH = 8
PRECISIONS = {"fp32": (4, FP32_REL), "fp64": (8, FP64_TOL)}  # bytes an element, tolerance


SETTINGS = [*TRAIN, "train.progress=false", f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=8",
            "train.lr=3e-3", "train.val_interval=5", "train.val_batches=3", "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, settings=SETTINGS, steps=STEPS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    """The single-process run in each precision: losses (fp32: of 10 steps), weights after 5,
    validation losses."""
    out = {}
    for precision in PRECISIONS:
        run_dir = tmp_path_factory.mktemp("ref") / "run"
        trainer = Trainer(make_cfg(run_dir, text_file, f"train.precision={precision}"))
        trainer.train(until_step=PARITY_STEPS)
        after5 = weights(trainer)
        if precision == "fp32":
            trainer.train()  # a 2-rank checkpoint resumes on 1 rank below: steps 6 to 10
        assert step_losses(run_dir)[PARITY_STEPS - 1] < step_losses(run_dir)[0] - 0.5  # parity is not trivial
        out[precision] = {"losses": step_losses(run_dir), "grad_norms": grad_norms(run_dir), "weights5": after5,
                          "val": val_losses(run_dir), "numel": trainer.base_model.num_params()}
    return out


def dp_worker(rank, world_size, root: Path, text_file: Path, configs: list[tuple], with_resume: bool):
    """configs: (micro-batch size, precision); with_resume: the first one also checks resuming."""
    out = {}
    for micro, precision in configs:
        cfg = make_cfg(root / f"m{micro}{precision}", text_file, f"train.micro_batch_size={micro}",
                       f"train.precision={precision}")
        trainer = Trainer(cfg)
        assert trainer.dp_size == world_size and trainer.loader.dp_rank == rank
        trainer.train(until_step=PARITY_STEPS)
        out[micro, precision] = {"weights5": weights(trainer)}
        if with_resume and (micro, precision) == configs[0]:
            trainer.train()  # the straight run: 10 steps in one go
            out["straight"] = (weights(trainer), trainer.optimizer.state_dict())
    if with_resume:
        micro, precision = configs[0]
        cfg = make_cfg(root / "split", text_file, f"train.micro_batch_size={micro}", f"train.precision={precision}")
        Trainer(cfg).train(until_step=PARITY_STEPS)
        dist.barrier()
        if rank == 0:  # kept for the parent to resume at another world size
            shutil.copytree(root / "split", root / "other_world")
        dist.barrier()
        resumed = Trainer(cfg, resume=True)
        assert resumed.step == PARITY_STEPS and resumed.resume_note is None
        resumed.train()
        out["resumed"] = (weights(resumed), resumed.optimizer.state_dict())
    return out


def check_parity(results, root: Path, reference, configs):
    for micro, precision in configs:
        size, tol = PRECISIONS[precision]
        ref = reference[precision]
        what = f"dp={len(results)} micro={micro} {precision}"
        run_dir = root / f"m{micro}{precision}"
        losses = step_losses(run_dir)  # written by rank 0 only: one row per step
        assert len(losses) in (PARITY_STEPS, STEPS)  # the straight run went on to 10
        assert_close_seq(losses[:PARITY_STEPS], ref["losses"][:PARITY_STEPS], rtol=tol, what=f"{what}: loss")
        # The gradient norm before clipping shows a gradient off by a constant factor (reduced
        # twice, or averaged instead of summed), which AdamW and clipping all but hide in the weights.
        assert_close_seq(grad_norms(run_dir)[:PARITY_STEPS], ref["grad_norms"][:PARITY_STEPS], rtol=tol,
                         what=f"{what}: grad norm")
        # the validation loss: the same set (3 global batches) split over the ranks, averaged;
        # steps 0 and 5 (a run stopped at step 5 has no step-10 row)
        got_val, want_val = val_losses(run_dir)[:2], ref["val"][:2]
        assert [s for s, _ in got_val] == [s for s, _ in want_val] == [0, PARITY_STEPS], (got_val, want_val)
        assert_close_seq([v for _, v in got_val], [v for _, v in want_val], rtol=tol, what=f"{what}: val loss")
        if precision == "fp64":
            for r, result in enumerate(results):
                assert_state_close(result[micro, precision]["weights5"], ref["weights5"], atol=tol,
                                   what=f"{what} rank {r}: weights after {PARITY_STEPS} steps")
        # the step's communication, per axis: exactly the gradient bytes, all-reduced once per
        # step however many accumulation micro-steps there were
        for row in (r for r in rows(run_dir) if "loss" in r):
            assert row["comm_mb"] == {"dp": size * ref["numel"] / 2**20}, row
            assert row["comm_s"]["dp"] >= 0


def test_dp2_matches_single_process_and_resumes_bit_identically(tmp_path, text_file, reference):
    configs = [(4, "fp32"), (2, "fp64")]  # per-rank batch 4: one micro-batch, then 2 accumulated
    results = run_distributed(dp_worker, 2, tmp_path, text_file, configs, True, timeout=120)
    check_parity(results, tmp_path, reference, configs)

    # 10 straight == 5 + resume + 5, on every rank: losses, weights, optimizer state
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "m4fp32")
    for r, result in enumerate(results):
        (w_straight, opt_straight), (w_resumed, opt_resumed) = result["straight"], result["resumed"]
        for name in w_straight:
            assert torch.equal(w_straight[name], w_resumed[name]), (r, name)
        for a, b in zip(opt_straight["state"].values(), opt_resumed["state"].values()):
            assert all(torch.equal(a[k], b[k]) for k in a), r
    checkpoint = latest_checkpoint(tmp_path / "split")
    assert sorted(p.name for p in checkpoint.glob("rank_*.json")) == ["rank_00000.json", "rank_00001.json"]

    # The loader position is global, so a checkpoint of 2 ranks resumes on 1: same batches, equal
    # within fp32 rounding (not bit-identical: the sums over ranks are ordered differently).
    single = Trainer(make_cfg(tmp_path / "other_world", text_file, "train.precision=fp32"), resume=True)
    assert single.step == PARITY_STEPS and "saved by 2 ranks" in single.resume_note
    single.train()
    assert_close_seq(step_losses(tmp_path / "other_world"), reference["fp32"]["losses"], rtol=FP32_REL,
                     what="dp=2 checkpoint resumed on 1 rank: loss")


def test_dp4_matches_single_process(tmp_path, text_file, reference):
    configs = [(2, "fp64"), (1, "fp32")]  # per-rank batch 2: one micro-batch, then 2 accumulated
    results = run_distributed(dp_worker, 4, tmp_path, text_file, configs, False, timeout=180)
    check_parity(results, tmp_path, reference, configs)


# A large aux coefficient, so that a mis-scaled load-balancing loss moves the routers visibly.
MOE = ["model.num_experts=4", "model.num_experts_per_token=2", "model.moe_intermediate_size=32",
       "model.router_aux_loss_coef=0.5", "train.micro_batch_size=4", "train.steps=3", "train.val_batches=0"]


def moe_worker(rank, world_size, run_dir, text_file):
    out = {}
    for precision in PRECISIONS:
        trainer = Trainer(make_cfg(run_dir / precision, text_file, *MOE, f"train.precision={precision}"))
        trainer.train()
        out[precision] = weights(trainer)
    return out


def test_moe_aux_loss_under_dp_matches_single_process(tmp_path, text_file):
    # The aux loss is a mean over the micro-batches of the global batch: one micro-batch on each of
    # 2 ranks must train exactly like 2 accumulated micro-batches in one process. A mis-scaled aux
    # loss shows in the grad norm (the coefficient is large) and, in fp64, in the router weights.
    results = run_distributed(moe_worker, 2, tmp_path / "dp", text_file, timeout=120)
    for precision, (_, tol) in PRECISIONS.items():
        single = Trainer(make_cfg(tmp_path / "single" / precision, text_file, *MOE, f"train.precision={precision}"))
        single.train()
        got_dir, want_dir = tmp_path / "dp" / precision, tmp_path / "single" / precision
        assert_close_seq(step_losses(got_dir), step_losses(want_dir), rtol=tol, what=f"MoE dp=2 {precision}: loss")
        assert_close_seq(grad_norms(got_dir), grad_norms(want_dir), rtol=tol, what=f"MoE dp=2 {precision}: grad norm")
        if precision == "fp64":
            for r, got in enumerate(results):
                assert_state_close(got[precision], weights(single), atol=tol, what=f"MoE dp=2 fp64 rank {r}: weights")


# -- parallelize / check_layout, in one process -------------------------------------------------


def test_check_layout_names_the_numbers_and_the_fix(text_file, tmp_path):
    cfg = make_cfg(tmp_path, text_file, "train.micro_batch_size=2")
    assert check_layout(cfg, 4).dp == 4
    with pytest.raises(ValueError, match=r"global_batch_size=8 is not divisible by .* 4 x 4 = 16.*multiple of 16"):
        check_layout(make_cfg(tmp_path, text_file, "train.micro_batch_size=4"), 4)
    with pytest.raises(ValueError, match=r"tp=3 = 3 does not divide world size 4; choose tp in \{1,2,4\}"):
        check_layout(make_cfg(tmp_path, text_file, "parallel.tp=3"), 4)
    # tp: tests/test_train_tp.py; pp: tests/test_train_pp.py; cp: tests/test_train_cp.py; ep: tests/test_train_ep.py


def test_default_config_runs_on_2_and_4_ranks():
    # `meshlm train --nproc 2` / `--nproc 4` with the built-in defaults (README): the micro-batch
    # defaults to the whole per-rank batch, so any dp that divides the global batch works.
    cfg = load_config()
    assert cfg.train.micro_batch_size == 0
    for world in (1, 2, 4):
        assert check_layout(cfg, world).dp == world
    with pytest.raises(ValueError, match=r"global_batch_size=32 is not divisible by the data-parallel degree 3"):
        check_layout(cfg, 3)


def test_parallelize_refuses_unsupported_settings_and_a_second_pass(text_file, tmp_path):
    cfg = make_cfg(tmp_path, text_file)
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    model = build_model(cfg.model, seed=0)
    cfg.parallel.cp = 2
    with pytest.raises(ValueError, match="parallel.cp=2 but the mesh has cp=1"):
        parallelize(model, mesh, cfg.parallel)
    cfg.parallel.cp = 1
    cfg.parallel.pp = 2
    with pytest.raises(ValueError, match="parallel.pp=2 but the mesh has pp=1"):
        parallelize(model, mesh, cfg.parallel)
    cfg.parallel.pp = 1
    result = parallelize(model, mesh, cfg.parallel)  # the refusal above changed nothing
    assert result.module is model and result.data_parallel is None and result.grad_norm_fn is None
    assert (result.dp_rank, result.dp_size) == (0, 1)
    with pytest.raises(ValueError, match="parallelized already"):
        parallelize(model, mesh, cfg.parallel)
