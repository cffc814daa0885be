"""The Trainer under tensor parallelism (+ sequence parallelism, + data parallelism) reproduces the
single-process Trainer, its checkpoints hold the full tensors (a tp=2 checkpoint resumes in one
process, and at tp=2 bit-identically), and layouts that cannot run are refused before any work.

One launch per world size keeps this file fast: each rank runs every configuration in turn.
"""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from meshlm.config import load_config
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.parallel.parallelize import check_layout, parallelize
from meshlm.parallel.tensor import full_state_dict
from meshlm.train.trainer import Trainer
from runs import SMALL_MODEL, grad_norms, step_losses, val_losses

STEPS = 7
PARITY_STEPS = 5
TOL = 1e-5
# Adam's step is lr * m / (sqrt(v) + eps): with the default eps=1e-8 a gradient entry of ~1e-9 turns
# the 1e-11 summation-order differences of the tp reductions into a ~1e-5 weight difference (1.2e-5
# seen in lm_head after 5 steps); eps=1e-6 bounds that amplification (see tests/test_tensor.py).
ADAM_EPS = "train.eps=1e-6"


def make_cfg(run_dir, text_file, *extra):
    return load_config(overrides=[*SMALL_MODEL, f"data.path={text_file}", f"train.run_dir={run_dir}",
                                  "train.progress=false", "train.seq_len=32", "train.global_batch_size=8",
                                  "train.micro_batch_size=4", f"train.steps={STEPS}", "train.warmup_steps=2",
                                  "train.lr=3e-3", "train.val_interval=5", "train.val_batches=2",
                                  "data.val_fraction=0.1", "train.device=cpu", "parallel.bucket_size_mb=0.02",
                                  ADAM_EPS, *extra])


def full_weights(trainer) -> dict:
    """The reference-layout weights (gathered over tp; collective under tp)."""
    return full_state_dict(trainer.base_model, trainer.mesh)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    """The single-process run: losses and grad norms of 7 steps, weights after 5, validation losses."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    trainer = Trainer(make_cfg(run_dir, text_file))
    trainer.train(until_step=PARITY_STEPS)
    after5 = {k: v.detach().clone() for k, v in trainer.base_model.state_dict().items()}
    trainer.train()
    losses = step_losses(run_dir)
    assert losses[PARITY_STEPS - 1] < losses[0] - 0.5  # parity is not trivial
    return {"losses": losses, "grad_norms": grad_norms(run_dir), "weights5": after5, "val": val_losses(run_dir)}


def tp_worker(rank, world_size, root: Path, text_file: Path, tp: int, micro: int, with_resume: bool):
    out = {}
    cfg = make_cfg(root / "parity", text_file, f"parallel.tp={tp}", f"train.micro_batch_size={micro}")
    trainer = Trainer(cfg)
    assert trainer.mesh.size("tp") == tp and trainer.dp_size == world_size // tp
    trainer.train(until_step=PARITY_STEPS)
    out["weights5"] = full_weights(trainer)
    # the end-of-training sample runs on a full copy: the same text on every rank
    out["sample"] = trainer.sample("def f", 8, temperature=0)
    if with_resume:
        trainer.train()  # the straight run: 7 steps in one go
        out["straight"] = full_weights(trainer)
        split = make_cfg(root / "split", text_file, f"parallel.tp={tp}", f"train.micro_batch_size={micro}")
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
    return out


def check_parity(results, run_dir: Path, reference):
    losses = step_losses(run_dir)[:PARITY_STEPS]  # rank 0 writes one row per step
    assert losses == pytest.approx(reference["losses"][:PARITY_STEPS], rel=TOL), (losses, reference["losses"])
    # a gradient off by a constant factor (a shard counted twice, a tp reduction missing) shows here
    norms = grad_norms(run_dir)[:PARITY_STEPS]
    assert norms == pytest.approx(reference["grad_norms"][:PARITY_STEPS], rel=TOL), (norms, reference["grad_norms"])
    got_val = val_losses(run_dir)
    assert len(got_val) >= 2
    for (step, got), (ref_step, want) in zip(got_val, reference["val"]):
        assert step == ref_step and abs(got - want) <= TOL * abs(want), (step, got, want)
    for r, result in enumerate(results):
        for name, want in reference["weights5"].items():
            # fp32 sums over tp ranks round differently, and AdamW magnifies that where gradients
            # are tiny, in proportion to the lr (see tests/test_train_dp.py and tests/test_tensor.py)
            diff = float((result["weights5"][name] - want).abs().max())
            assert diff <= TOL, f"rank {r} {name}: max |difference| {diff:.2e}"
        assert result["sample"] == results[0]["sample"] and isinstance(result["sample"], str)


def test_tp2_matches_single_process_and_checkpoints_are_full(tmp_path, text_file, reference):
    # tp=2 with sequence parallelism, 2 accumulated micro-batches of 4
    results = run_distributed(tp_worker, 2, tmp_path, text_file, 2, 4, True, timeout=150)
    check_parity(results, tmp_path / "parity", reference)

    # 7 straight == 5 + resume + 2 at tp=2, bit-identical: losses, weights, optimizer moments
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "parity")
    for r, result in enumerate(results):
        for name, want in result["straight"].items():
            assert torch.equal(result["resumed"][name], want), (r, name)
        assert all(torch.equal(a, b) for a, b in zip(result["resumed_exp_avg"], result["straight_exp_avg"])), r

    # The checkpoint holds the full tensors: a tp=2 checkpoint resumes in one process.
    single = Trainer(make_cfg(tmp_path / "single", text_file), resume=True)
    assert single.step == PARITY_STEPS and "saved by 2 ranks" in single.resume_note
    for name, want in results[0]["weights5"].items():
        assert torch.equal(single.base_model.state_dict()[name], want), name
    single.train(until_step=PARITY_STEPS + 1)
    next_loss = step_losses(tmp_path / "single")[PARITY_STEPS]
    want = reference["losses"][PARITY_STEPS]
    assert abs(next_loss - want) <= TOL * abs(want), (next_loss, want)


def test_tp2_dp2_matches_single_process(tmp_path, text_file, reference):
    # world 4: tp=2 x dp=2, per-dp-rank batch 4 as 2 accumulated micro-batches of 2
    results = run_distributed(tp_worker, 4, tmp_path, text_file, 2, 2, False, timeout=150)
    check_parity(results, tmp_path / "parity", reference)


# -- bad layouts, in one process ----------------------------------------------------------------


def test_bad_tensor_parallel_layouts_are_refused_with_the_fix(text_file, tmp_path):
    cfg = lambda *extra: make_cfg(tmp_path, text_file, *extra)  # noqa: E731
    assert check_layout(cfg("parallel.tp=2"), 4).tp == 2
    with pytest.raises(ValueError, match=r"parallel.zero_stage=1 together with parallel.tp=2 is not implemented yet"):
        check_layout(cfg("parallel.tp=2", "parallel.zero_stage=1"), 4)
    with pytest.raises(ValueError, match=r"model.num_heads=4 is not divisible by tp=3"):
        check_layout(cfg("parallel.tp=3", "train.micro_batch_size=2"), 6)
    with pytest.raises(ValueError, match=r"train.seq_len=30 is not divisible by parallel.tp=4.*multiple of 4"):
        check_layout(cfg("parallel.tp=4", "model.num_kv_heads=4", "train.seq_len=30"), 4)
    # without sequence parallelism the sequence is not split
    check_layout(cfg("parallel.tp=4", "model.num_kv_heads=4", "train.seq_len=30",
                     "parallel.sequence_parallel=false"), 4)
    with pytest.raises(ValueError, match=r"tensor parallelism of MoE layers is not implemented"):
        check_layout(cfg("parallel.tp=2", "model.num_experts=4", "model.num_experts_per_token=2",
                         "model.moe_intermediate_size=32"), 2)

    # parallelize checks the same before touching the model
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    c = cfg()
    model = build_model(c.model, seed=0)
    c.parallel.tp = 2
    with pytest.raises(ValueError, match=r"parallel.tp=2 but the mesh has tp=1"):
        parallelize(model, mesh, c.parallel)
    c.parallel.tp, c.parallel.zero_stage = 2, 2
    with pytest.raises(ValueError, match=r"parallel.zero_stage=2 together with parallel.tp=2"):
        parallelize(model, mesh, c.parallel)
    c.parallel.tp, c.parallel.zero_stage = 1, 0
    assert parallelize(model, mesh, c.parallel).tensor_parallel is False  # the refusals changed nothing
