"""The Trainer under tensor parallelism (+ sequence parallelism, + data parallelism) reproduces the
single-process Trainer, its checkpoints hold the full tensors (a tp=2 checkpoint resumes in one
process, and at tp=2 bit-identically), and layouts that cannot run are refused before any work.

Parity (tests/parity.py): a run with train.precision=fp64 matches the fp64 single-process run in
losses, grad norms, validation losses and every weight to FP64_TOL; a run in fp32 (the real dtype)
in losses, grad norms and validation losses to FP32_REL. tp=2 runs in both precisions (the fp32 one
also checkpoints and resumes), tp=2 x dp=2 in fp64.

One launch per world size keeps this file fast: each rank runs every configuration in turn.
"""

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.parallel.parallelize import check_layout, parallelize
from meshlm.train.trainer import Trainer
from parity import FP32_REL, FP64_TOL, assert_close_seq, assert_state_close
from runs import TRAIN, full_weights, grad_norms, step_losses, train_config, val_losses

STEPS = 7
PARITY_STEPS = 5
TOLS = {"fp32": FP32_REL, "fp64": FP64_TOL}


SETTINGS = [*TRAIN, "train.progress=false", "train.global_batch_size=8", "train.micro_batch_size=4", "train.lr=3e-3",
            "train.val_interval=5", "train.val_batches=2", "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, settings=SETTINGS, steps=STEPS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    """The single-process run in each precision: losses and grad norms (fp32: of 7 steps), weights
    after 5, validation losses."""
    out = {}
    for precision in TOLS:
        run_dir = tmp_path_factory.mktemp("ref") / "run"
        trainer = Trainer(make_cfg(run_dir, text_file, f"train.precision={precision}"))
        trainer.train(until_step=PARITY_STEPS)
        after5 = {k: v.detach().clone() for k, v in trainer.base_model.state_dict().items()}
        if precision == "fp32":
            trainer.train()  # the tp=2 checkpoint resumes in one process below: step 6
        losses = step_losses(run_dir)
        assert losses[PARITY_STEPS - 1] < losses[0] - 0.5  # parity is not trivial
        out[precision] = {"losses": losses, "grad_norms": grad_norms(run_dir), "weights5": after5,
                          "val": val_losses(run_dir)}
    return out


def tp_worker(rank, world_size, root: Path, text_file: Path, tp: int, micro: int, precisions: list[str],
              with_resume: bool):
    """A parity run per precision; with_resume: the first one goes on to check resuming."""
    out = {}
    for precision in precisions:
        cfg = make_cfg(root / f"parity_{precision}", text_file, f"parallel.tp={tp}", f"train.micro_batch_size={micro}",
                       f"train.precision={precision}")
        trainer = Trainer(cfg)
        assert trainer.mesh.size("tp") == tp and trainer.dp_size == world_size // tp
        trainer.train(until_step=PARITY_STEPS)
        # the end-of-training sample runs on a full copy: the same text on every rank
        out[precision] = {"weights5": full_weights(trainer), "sample": trainer.sample("def f", 8, temperature=0)}
        if with_resume and precision == precisions[0]:
            resume_check(rank, out, trainer, root, text_file, tp, micro, precision)
    return out


def resume_check(rank, out, trainer, root: Path, text_file: Path, tp: int, micro: int, precision: str):
    """7 straight steps (the parity run goes on) vs 5 + save + resume + 2; keeps the checkpoint at 5."""
    trainer.train()  # the straight run: 7 steps in one go
    out["straight"] = full_weights(trainer)
    split = make_cfg(root / "split", text_file, f"parallel.tp={tp}", f"train.micro_batch_size={micro}",
                     f"train.precision={precision}")
    Trainer(split).train(until_step=PARITY_STEPS)
    dist.barrier()
    if rank == 0:  # kept for the parent to resume in one process
        shutil.copytree(root / "split", root / "single")
    dist.barrier()
    resumed = Trainer(split, resume=True)
    assert resumed.step == PARITY_STEPS and resumed.resume_note is None
    resumed.train()
    out["resumed"] = full_weights(resumed)
    out["resumed_exp_avg"] = [s["exp_avg"].clone() for s in resumed.optimizer.state.values()]
    out["straight_exp_avg"] = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]


def check_parity(results, root: Path, reference, precision: str):
    tol, ref, run_dir = TOLS[precision], reference[precision], root / f"parity_{precision}"
    what = f"tp=2 dp={len(results) // 2} {precision}"
    losses = step_losses(run_dir)[:PARITY_STEPS]  # rank 0 writes one row per step
    assert_close_seq(losses, ref["losses"][:PARITY_STEPS], rtol=tol, what=f"{what}: loss")
    # a gradient off by a constant factor (a shard counted twice, a tp reduction missing) shows here
    assert_close_seq(grad_norms(run_dir)[:PARITY_STEPS], ref["grad_norms"][:PARITY_STEPS], rtol=tol,
                     what=f"{what}: grad norm")
    got_val, want_val = val_losses(run_dir)[:2], ref["val"][:2]  # steps 0 and 5
    assert [s for s, _ in got_val] == [s for s, _ in want_val] == [0, PARITY_STEPS], (got_val, want_val)
    assert_close_seq([v for _, v in got_val], [v for _, v in want_val], rtol=tol, what=f"{what}: val loss")
    for r, result in enumerate(results):
        if precision == "fp64":
            assert_state_close(result[precision]["weights5"], ref["weights5"], atol=tol,
                               what=f"{what} rank {r}: weights after {PARITY_STEPS} steps")
        sample = result[precision]["sample"]
        assert sample == results[0][precision]["sample"] and isinstance(sample, str)


def test_tp2_matches_single_process_and_checkpoints_are_full(tmp_path, text_file, reference):
    # tp=2 with sequence parallelism, 2 accumulated micro-batches of 4; fp32 first (it resumes)
    results = run_distributed(tp_worker, 2, tmp_path, text_file, 2, 4, ["fp32", "fp64"], True, timeout=150)
    for precision in ("fp32", "fp64"):
        check_parity(results, tmp_path, reference, precision)

    # 7 straight == 5 + resume + 2 at tp=2, bit-identical: losses, weights, optimizer moments
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "parity_fp32")
    for r, result in enumerate(results):
        for name, want in result["straight"].items():
            assert torch.equal(result["resumed"][name], want), (r, name)
        assert all(torch.equal(a, b) for a, b in zip(result["resumed_exp_avg"], result["straight_exp_avg"])), r

    # The checkpoint holds the full tensors: a tp=2 checkpoint resumes in one process.
    single = Trainer(make_cfg(tmp_path / "single", text_file, "train.precision=fp32"), resume=True)
    assert single.step == PARITY_STEPS and "saved by 2 ranks" in single.resume_note
    for name, want in results[0]["fp32"]["weights5"].items():
        assert torch.equal(single.base_model.state_dict()[name], want), name
    single.train(until_step=PARITY_STEPS + 1)
    assert_close_seq([step_losses(tmp_path / "single")[PARITY_STEPS]], [reference["fp32"]["losses"][PARITY_STEPS]],
                     rtol=FP32_REL, what="tp=2 checkpoint resumed in one process: loss of the next step")


def test_tp2_dp2_matches_single_process(tmp_path, text_file, reference):
    # world 4: tp=2 x dp=2, per-dp-rank batch 4 as 2 accumulated micro-batches of 2
    results = run_distributed(tp_worker, 4, tmp_path, text_file, 2, 2, ["fp64"], False, timeout=150)
    check_parity(results, tmp_path, reference, "fp64")


# -- bad layouts, in one process ----------------------------------------------------------------


def test_bad_tensor_parallel_layouts_are_refused_with_the_fix(text_file, tmp_path):
    cfg = lambda *extra: make_cfg(tmp_path, text_file, *extra)  # noqa: E731
    assert check_layout(cfg("parallel.tp=2"), 4).tp == 2
    assert check_layout(cfg("parallel.tp=2", "parallel.zero_stage=3"), 4).dp_shard == 2  # ZeRO x TP runs
    with pytest.raises(ValueError, match=r"model.num_heads=4 is not divisible by tp=3"):
        check_layout(cfg("parallel.tp=3", "train.micro_batch_size=2"), 6)
    with pytest.raises(ValueError, match=r"train.seq_len=30 is not divisible by parallel.tp=4.*multiple of 4"):
        check_layout(cfg("parallel.tp=4", "model.num_kv_heads=4", "train.seq_len=30"), 4)
    # without sequence parallelism the sequence is not split
    check_layout(cfg("parallel.tp=4", "model.num_kv_heads=4", "train.seq_len=30",
                     "parallel.sequence_parallel=false"), 4)
    # a dropless MoE runs under SP (tests/test_train_ep.py); a capacity factor does not
    moe = ("model.num_experts=4", "model.num_experts_per_token=2", "model.moe_intermediate_size=32")
    check_layout(cfg("parallel.tp=2", *moe), 2)
    with pytest.raises(ValueError, match=r"capacity_factor=1.25 with tensor parallelism.*capacity_factor=0"):
        check_layout(cfg("parallel.tp=2", *moe, "model.capacity_factor=1.25"), 2)

    # parallelize checks the same before touching the model
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    c = cfg()
    model = build_model(c.model, seed=0)
    c.parallel.tp = 2
    with pytest.raises(ValueError, match=r"parallel.tp=2 but the mesh has tp=1"):
        parallelize(model, mesh, c.parallel)
    c.parallel.tp = 1
    assert parallelize(model, mesh, c.parallel).tensor_parallel is False  # the refusals changed nothing
