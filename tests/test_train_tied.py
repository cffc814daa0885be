"""Tied embeddings under pipeline parallelism reproduce the single-process run (`meshlm verify`, fp64).

The embedding (first stage) and the output head (last stage) are two copies of one weight: they start
equal, add their gradients over "pp_ends" before the data-parallel reduction, count once in the gradient
norm and are written once to the checkpoint ("embed.weight", as one process writes it). verify compares
losses, grad norms and every final weight of the saved checkpoint against one process.
"""

import io

import pytest

from meshlm import verify
from meshlm.config import load_config
from parity import FP64_TOL
from runs import SMALL_MODEL, harness_launch

STEPS = 4
SETTINGS = [*SMALL_MODEL, "model.num_layers=4", "model.tie_embeddings=true", "train.seq_len=32",
            "train.global_batch_size=8", "train.micro_batch_size=1", "train.lr=3e-3", "train.warmup_steps=2",
            "train.device=cpu", "data.val_fraction=0.1", "parallel.bucket_size_mb=0.02"]

LAYOUTS = {  # id: (ranks, settings, axes that must have moved bytes)
    "pp2": (2, ["parallel.pp=2"], {"pp", "pp_ends"}),
    "pp4": (4, ["parallel.pp=4"], {"pp", "pp_ends"}),
    "pp2_interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_chunks=2"],
                        {"pp", "pp_ends"}),
    "pp2_zero_bubble": (2, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble"], {"pp", "pp_ends"}),
    # the head's copy is a tp shard like the embedding's (vocab rows); ZeRO's norm skips the copy's elements
    "pp2xtp2xzero1": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.zero_stage=1"],
                      {"pp", "pp_ends", "tp", "dp_shard"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_embeddings_under_pp_match_one_process(tmp_path, text_file, layout):
    nproc, settings, axes = LAYOUTS[layout]
    cfg = load_config(overrides=[*SETTINGS, f"data.path={text_file}", *settings])
    report = verify.run(cfg, nproc=nproc, steps=STEPS, run_dir=tmp_path, launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL
    assert axes <= set(report.comm_bytes), report.comm_bytes


def train_until(rank, world_size, cfg, step, resume):
    from meshlm.train.trainer import Trainer

    Trainer(cfg, resume=resume).train(until_step=step)


@pytest.mark.parametrize("ranks, extra", [(2, []), (4, ["parallel.zero_stage=2"])])
def test_a_tied_checkpoint_moves_between_pp2_and_one_process(tmp_path, text_file, ranks, extra):
    """pp=2 saves the tied weight once, as one process does (under ZeRO the head's copy of the moments, cut
    by other shards than the embedding's, is not written): one process resumes the pp=2 checkpoint, and
    pp=2 resumes one process's; both continue exactly as the uninterrupted one-process run."""
    from dist import run_distributed
    from meshlm.train.trainer import Trainer
    from runs import step_losses

    steps = ["train.steps=4", "train.precision=fp64", "train.val_batches=0", "train.sample_tokens=0",
             "train.progress=false"]

    def cfg(name, *extra):
        return load_config(overrides=[*SETTINGS, f"data.path={text_file}", *steps, f"train.run_dir={tmp_path / name}",
                                      *extra])

    Trainer(cfg("one")).train()
    want = step_losses(tmp_path / "one")
    run_distributed(train_until, ranks, cfg("pp_then_one", "parallel.pp=2", *extra), 2, False)
    Trainer(cfg("pp_then_one"), resume=True).train()
    Trainer(cfg("one_then_pp")).train(until_step=2)
    run_distributed(train_until, ranks, cfg("one_then_pp", "parallel.pp=2", *extra), 4, True)
    for name in ("pp_then_one", "one_then_pp"):
        got = step_losses(tmp_path / name)
        assert len(got) == len(want) == 4
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= FP64_TOL, (name, got, want)
