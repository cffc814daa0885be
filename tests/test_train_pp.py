"""The Trainer under pipeline parallelism (parallel.pp > 1) reproduces the single-process Trainer.

fp64 parity (tests/parity.py, FP64_TOL): losses, grad norms, validation losses, the weights after 5
steps (each stage returns its own; together they are the whole model) and the end-of-training sample,
for every schedule at pp=2 and for pp=2 x dp=2 at 4 ranks. A pp=2 checkpoint resumes on one process.
One launch per world size; each rank trains every configuration in turn.
"""

import shutil
from pathlib import Path

import pytest
import torch

from dist import run_distributed
from meshlm.config import load_config
from meshlm.parallel.parallelize import check_layout
from meshlm.train.trainer import Trainer
from parity import FP64_TOL, assert_close_seq, assert_state_close
from runs import SMALL_MODEL, grad_norms, step_losses, val_losses

STEPS = 5
GLOBAL_BATCH = 8
# (name, overrides): pp=2 at 2 ranks, pp=2 x dp=2 at 4
LAYOUTS = {
    2: [("gpipe", ["parallel.pp_schedule=gpipe"]),
        ("1f1b", ["parallel.pp_schedule=1f1b"]),
        ("interleaved", ["parallel.pp_schedule=interleaved", "parallel.pp_chunks=2"]),
        ("zero_bubble", ["parallel.pp_schedule=zero_bubble"])],
    4: [("1f1b_dp2", ["parallel.pp_schedule=1f1b"]),
        ("zero_bubble_dp2", ["parallel.pp_schedule=zero_bubble"])],
}


def make_cfg(run_dir, text_file, *extra):
    return load_config(overrides=[*SMALL_MODEL, "model.num_layers=4", f"data.path={text_file}",
                                  f"train.run_dir={run_dir}", "train.progress=false", "train.seq_len=32",
                                  f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=1",
                                  f"train.steps={STEPS}", "train.warmup_steps=2", "train.lr=3e-3", "train.lr_schedule=constant",
                                  "train.val_interval=5", "train.val_batches=2", "data.val_fraction=0.1",
                                  "train.device=cpu", "train.precision=fp64", "parallel.bucket_size_mb=0.02",
                                  *extra])


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.base_model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    trainer = Trainer(make_cfg(run_dir, text_file, "train.steps=8"))
    trainer.train(until_step=STEPS)
    out = {"weights": weights(trainer), "sample": trainer.sample("def f", 12)}
    trainer.train()  # on to 8: the pp=2 checkpoint resumes on one process and must continue the same way
    assert step_losses(run_dir)[STEPS - 1] < step_losses(run_dir)[0] - 0.3  # parity is not trivial
    return {**out, "losses": step_losses(run_dir), "grad_norms": grad_norms(run_dir), "val": val_losses(run_dir)}


def pp_worker(rank, world_size, root: Path, text_file: Path):
    out = {}
    for name, extra in LAYOUTS[world_size]:
        cfg = make_cfg(root / name, text_file, "parallel.pp=2", *extra)
        trainer = Trainer(cfg)
        assert trainer.mesh.size("pp") == 2 and trainer.dp_size == world_size // 2
        trainer.train()
        sched = [t.action for t in trainer.pipeline_timeline]
        out[name] = {"weights": weights(trainer), "sample": trainer.sample("def f", 12), "order": sched,
                     "keys": sorted(trainer.base_model.state_dict())}
    return out


def _merge(results, name) -> dict:
    merged = {}
    for r in results[:2] if len(results) == 2 else results:
        merged.update(r[name]["weights"])  # dp replicas of a stage hold the same keys (and values)
    return merged


@pytest.mark.parametrize("world_size", [2, 4])
def test_trainer_pipeline_matches_one_process(world_size, tmp_path, text_file, reference):
    results = run_distributed(pp_worker, world_size, tmp_path, text_file, timeout=400)
    for name, _ in LAYOUTS[world_size]:
        what = f"pp=2 {name} ({world_size} ranks)"
        run_dir = tmp_path / name
        assert_close_seq(step_losses(run_dir), reference["losses"][:STEPS], rtol=FP64_TOL, what=f"{what}: loss")
        assert_close_seq(grad_norms(run_dir), reference["grad_norms"][:STEPS], rtol=FP64_TOL,
                         what=f"{what}: grad norm")
        got_val, want_val = val_losses(run_dir), reference["val"][:2]
        assert [s for s, _ in got_val] == [s for s, _ in want_val] == [0, STEPS]
        assert_close_seq([v for _, v in got_val], [v for _, v in want_val], rtol=FP64_TOL, what=f"{what}: val loss")
        for r, res in enumerate(results):
            assert_state_close(res[name]["weights"], {k: reference["weights"][k] for k in res[name]["keys"]},
                               atol=FP64_TOL, what=f"{what} rank {r}: weights")
            assert res[name]["sample"] == reference["sample"], f"{what} rank {r}: sample"
        stages = {tuple(res[name]["keys"]) for res in results}
        assert len(stages) == 2, f"{what}: two stages, each with its own parameters"
        assert sorted(k for s in stages for k in s) == sorted(reference["weights"]), what
    if world_size == 2:
        # the pp=2 checkpoint (each stage saved its own keys) resumes on one process
        name = LAYOUTS[2][1][0]
        shutil.copytree(tmp_path / name, tmp_path / "one")
        cfg = make_cfg(tmp_path / "one", text_file, "train.steps=8")
        resumed = Trainer(cfg, resume=True)
        assert resumed.step == STEPS and resumed.resume_note is not None
        merged = {}
        for res in results:
            merged.update(res[name]["weights"])
        assert_state_close(weights(resumed), merged, atol=0.0, what="pp=2 checkpoint loaded on one process")
        resumed.train()
        assert_close_seq(step_losses(tmp_path / "one")[STEPS:], reference["losses"][STEPS:], rtol=FP64_TOL,
                         what="pp=2 checkpoint resumed on one process: loss of steps 6-8")


def test_check_layout_refuses_what_pipeline_does_not_run_yet(tmp_path, text_file):
    assert check_layout(make_cfg(tmp_path, text_file, "parallel.pp=2"), 4).pp == 2
    for setting, match in (("parallel.tp=2", "parallel.tp=2 with parallel.pp=2 is not implemented yet"),
                           ("parallel.zero_stage=1", "parallel.zero_stage=1 with parallel.pp=2"),
                           ("parallel.recompute=full", "parallel.recompute=full with parallel.pp=2"),
                           ("model.tie_embeddings=true", "tie_embeddings"),
                           ("parallel.pp_chunks=2", "pp_chunks=2 needs pp_schedule='interleaved'"),
                           ("parallel.num_microbatches=3", "num_microbatches=3")):
        with pytest.raises(ValueError, match=match):
            check_layout(make_cfg(tmp_path, text_file, "parallel.pp=2", setting), 4)
    with pytest.raises(ValueError, match="needs num_microbatches=4 divisible by pp=8|must be >= parallel.pp"):
        check_layout(make_cfg(tmp_path, text_file, "parallel.pp=8", "parallel.pp_schedule=interleaved"), 8)
