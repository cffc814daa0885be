"""Training with data.document_mask=true reproduces the single-process run under every layout, in fp64.

Parity goes through `meshlm verify` (its ranks started by the test harness): losses and grad norms of every step
and every final weight within FP64_TOL of one process with the same setting -- under data parallelism, tensor
parallelism with sequence parallelism (+ selective recomputation), context parallelism (ring, all-gather,
Ulysses + full recomputation, the hybrid), the pipeline (1f1b; zero_bubble with cp), ZeRO-3 and expert
parallelism; validation losses under cp, tp and pp (which verify does not run) too. The corpus is many
short documents, so every sample of 32 tokens holds several (boundaries on and off the cp chunks' edges), and
the masked run must differ from the unmasked one. What the mask means is tests/test_document_mask.py's.
"""

import io
import json

import pytest

from meshlm import verify
from meshlm.config import load_config
from parity import FP64_TOL
from runs import SMALL_MODEL, harness_launch, step_losses

STEPS = 3
SETTINGS = [*SMALL_MODEL, "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.lr=3e-3", "train.warmup_steps=2", "train.device=cpu", "data.val_fraction=0.1",
            "train.val_interval=3", "train.val_batches=1", "parallel.bucket_size_mb=0.02"]


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory):
    """Short documents of varied lengths (3 to ~25 bytes, each followed by a blank line in the stream)."""
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    texts = [f"f{i}(x) = x * {i % 7}" + " + 1" * (i % 4) if i % 5 else f"#{i}" for i in range(400)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def make_cfg(path, *extra):
    return load_config(overrides=[*SETTINGS, f"data.path={path}", "data.document_mask=true", *extra])


LAYOUTS = {  # id: (ranks, settings)
    "dp2": (2, []),
    "tp2_sp_selective": (2, ["parallel.tp=2", "parallel.recompute=selective"]),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_method=ring"]),
    "cp2_allgather": (2, ["parallel.cp=2", "parallel.cp_method=allgather"]),
    "cp2_ulysses_full": (2, ["parallel.cp=2", "parallel.cp_method=ulysses", "parallel.recompute=full"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "cp4_hybrid_ulysses2": (4, ["parallel.cp=4", "parallel.cp_ulysses=2"]),
    "cp2_pp2_zero_bubble": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=zero_bubble"]),
    "zero3_dp2": (2, ["parallel.zero_stage=3"]),
    "ep2_moe": (2, ["parallel.ep=2", "model.num_experts=4", "model.num_experts_per_token=2",
                    "model.moe_intermediate_size=32"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_the_single_process_run_in_fp64(tmp_path, documents_file, layout):
    nproc, settings = LAYOUTS[layout]
    report = verify.run(make_cfg(documents_file, *settings), nproc=nproc, steps=STEPS, run_dir=tmp_path,
                        launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    worst = max(max(r.loss[2], r.grad_norm[2]) for r in report.rows)
    assert worst <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL, verify.format_report(report)
    print(f"{layout}: loss/grad-norm rel {worst:.1e}, weights {report.max_weight_diff:.1e}")


def test_the_mask_changes_the_training_run(tmp_path, documents_file):
    from meshlm.train.trainer import Trainer

    losses = []
    for on in ("true", "false"):
        cfg = make_cfg(documents_file, "train.steps=2", "train.precision=fp64", f"data.document_mask={on}",
                       f"train.run_dir={tmp_path / on}", "train.progress=false", "train.val_batches=0")
        Trainer(cfg).train()
        losses.append(step_losses(tmp_path / on))
    assert all(abs(a - b) > 1e-4 for a, b in zip(*losses)), losses


VALIDATION = {"cp2_ring": ["parallel.cp=2"], "tp2_sp": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}


def validation_worker(rank, world_size, path, root):
    """Each layout's validation loss of the initial weights (verify runs none), on 2 ranks."""
    from meshlm.train.trainer import Trainer

    return {name: Trainer(make_cfg(path, *settings, "train.precision=fp64", f"train.run_dir={root}/{name}",
                                   "train.progress=false")).evaluate()
            for name, settings in VALIDATION.items()}


def test_validation_losses_match_the_single_process_one(tmp_path, documents_file):
    from dist import run_distributed
    from meshlm.train.trainer import Trainer

    want = {on: Trainer(make_cfg(documents_file, "train.precision=fp64", f"data.document_mask={on}",
                                 f"train.run_dir={tmp_path / on}", "train.progress=false")).evaluate()
            for on in ("true", "false")}
    assert abs(want["true"] - want["false"]) > 1e-4, want
    for rank, got in enumerate(run_distributed(validation_worker, 2, str(documents_file), str(tmp_path))):
        for name, loss in got.items():
            assert abs(loss - want["true"]) <= FP64_TOL * abs(want["true"]), (rank, name, loss, want)
