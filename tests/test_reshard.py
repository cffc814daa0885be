"""The reshard matrix: a checkpoint saved under one layout resumes under another, through the CLI.

Each pair runs `meshlm train` under layout A to step 2 (its checkpoint), then `meshlm train --resume`
in the same run directory under layout B to step 4; steps 3-4 must match an uninterrupted one-process
run of 4 steps to 1e-5 relative (in float64 they agree to ~1e-12; the tolerance only leaves room for
summation order). Steps 1-2 are checked too: a layout that trains differently is not a resharding bug.

The runs go through `meshlm.cli.main(["train", ...])` itself: one-process layouts in this process, the
others on the ranks of tests/dist.py, where each rank drops the harness's process group and calls the
CLI with the environment torchrun would give it (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR and a
fresh MASTER_PORT), so that `cmd_train` starts its own group as it does under a launcher. When both
layouts of a pair are multi-rank, one launch runs both (A, then B), each on as many ranks as it needs:
a launch costs more than a run on this tiny model.

The learning rate is constant (no warmup): the schedule would otherwise depend on train.steps, and
stopping layout A at train.steps=2 must train exactly the first two steps of the 4-step run.
"""

import os
from pathlib import Path

import pytest

from meshlm.cli import main as cli_main
from parity import assert_close_seq
from runs import LAUNCH_ENV, SMALL_MODEL, rows, run_cli, step_losses

REL = 1e-5
STEPS, SAVE_AT = 4, 2
BASE = [*SMALL_MODEL, "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
        f"train.steps={STEPS}", f"train.checkpoint_interval={SAVE_AT}", "train.precision=fp64",
        "train.lr=3e-3", "train.lr_schedule=constant", "train.warmup_steps=0", "train.val_batches=0",
        "train.sample_tokens=0", "train.progress=false", "train.device=cpu", "data.val_fraction=0.1",
        "parallel.bucket_size_mb=0.02"]
MOE = ["model.num_experts=4", "model.num_experts_per_token=2", "model.moe_intermediate_size=32"]
# name: (ranks, overrides); dp is what is left of the world after tp x pp x cp.
LAYOUTS = {
    "1proc": (1, []),
    "dp2": (2, []),
    "zero1_dp2": (2, ["parallel.zero_stage=1"]),
    "zero2_dp4": (4, ["parallel.zero_stage=2"]),
    "zero3_dp2": (2, ["parallel.zero_stage=3"]),
    "hybrid_zero2_2x2": (4, ["parallel.dp_replicate=2", "parallel.zero_stage=2"]),
    "hybrid_zero3_2x2": (4, ["parallel.dp_replicate=2", "parallel.zero_stage=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_zero2_dp2": (4, ["parallel.tp=2", "parallel.zero_stage=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp2_zero3_dp2": (4, ["parallel.pp=2", "parallel.zero_stage=3"]),
    "cp2_ring": (2, ["parallel.cp=2", "parallel.cp_method=ring"]),
    "cp2_dp2": (4, ["parallel.cp=2"]),
    "moe_1proc": (1, MOE),
    "moe_ep2": (2, [*MOE, "parallel.ep=2"]),
    "moe_ep2_zero2": (2, [*MOE, "parallel.ep=2", "parallel.zero_stage=2"]),
}

PAIRS = [  # (save under, resume under)
    ("dp2", "1proc"),
    ("1proc", "zero3_dp2"),
    ("zero1_dp2", "zero2_dp4"),
    ("tp2", "dp2"),
    ("tp2_zero2_dp2", "pp2"),
    ("pp2", "tp2"),
    ("pp2", "pp2"),  # the last stage's optimizer groups: the checkpoint's name the first stage's parameters
    ("cp2_ring", "dp2"),
    ("dp2", "cp2_dp2"),
    ("moe_ep2", "moe_1proc"),
    ("moe_1proc", "moe_ep2_zero2"),
    ("hybrid_zero2_2x2", "zero3_dp2"),
    ("hybrid_zero3_2x2", "zero1_dp2"),
    ("pp2_zero3_dp2", "tp2"),  # each stage's ZeRO-3 flat shards -> whole tensors split over tp
    ("1proc", "pp2_zero3_dp2"),  # and back: whole tensors -> each stage's flat shards
]

def _is_moe(layout: str) -> bool:
    return layout.startswith("moe_")


def train_argv(run_dir: Path, text_file: Path, layout: str, *extra: str, resume: bool = False) -> list[str]:
    sets = [*BASE, f"data.path={text_file}", f"train.run_dir={run_dir}", *LAYOUTS[layout][1], *extra]
    return ["train", *(["--resume"] if resume else []), *[a for s in sets for a in ("--set", s)]]


@pytest.fixture(autouse=True)
def _not_a_rank(monkeypatch):
    """This test process may itself run under a launcher; its one-process runs must not think they are ranks."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file) -> dict[bool, list[float]]:
    """Uninterrupted one-process runs of 4 steps, dense and MoE: moe -> losses of steps 1..4."""
    out = {}
    saved = {k: os.environ.pop(k) for k in LAUNCH_ENV if k in os.environ}
    try:
        for moe in (False, True):
            run_dir = tmp_path_factory.mktemp("reference") / ("moe" if moe else "dense")
            assert cli_main(train_argv(run_dir, text_file, "moe_1proc" if moe else "1proc")) == 0
            out[moe] = step_losses(run_dir)
            assert len(out[moe]) == STEPS
    finally:
        os.environ.update(saved)
    return out


@pytest.mark.parametrize("save_in, resume_in", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resume_under_another_layout_continues_the_run(tmp_path, text_file, reference, capsys, save_in, resume_in):
    assert _is_moe(save_in) == _is_moe(resume_in)
    want = reference[_is_moe(save_in)]
    run_dir = tmp_path / "run"

    save, resume = run_cli([(train_argv(run_dir, text_file, save_in, f"train.steps={SAVE_AT}"), LAYOUTS[save_in][0]),
                            (train_argv(run_dir, text_file, resume_in, resume=True), LAYOUTS[resume_in][0])],
                           tmp_path)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{SAVE_AT:06d}",
                                                                                f"step_{STEPS:06d}"]
    logged = [(r["step"], r["loss"]) for r in rows(run_dir) if "loss" in r]
    assert [step for step, _ in logged] == list(range(1, STEPS + 1))  # A logged 1-2, B went on from 3
    losses = [loss for _, loss in logged]
    before = assert_close_seq(losses[:SAVE_AT], want[:SAVE_AT], rtol=REL, what=f"{save_in}: steps 1-{SAVE_AT}")
    after = assert_close_seq(losses[SAVE_AT:], want[SAVE_AT:], rtol=REL,
                             what=f"{save_in} -> {resume_in}: steps {SAVE_AT + 1}-{STEPS} after the resume")
    with capsys.disabled():  # the matrix, as `pytest -s` or not shows it
        print(f"\nRESHARD {save_in} -> {resume_in}: max rel diff steps 1-{SAVE_AT} {before:.2e}, "
              f"steps {SAVE_AT + 1}-{STEPS} {after:.2e}; save {save:.1f} s, resume {resume:.1f} s")
