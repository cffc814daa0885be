"""`meshlm verify`: every layout that runs today matches the single-process run in fp64 (exit 0), a
planted gradient bug is caught (exit 1, the table shows where), a layout that cannot run is refused
with one line (exit 2), and the command works end to end through the elastic launcher.

The layout tests start their ranks through `verify.run(..., launch=...)` with the test harness
(`tests/dist.py`), which skips the launcher's start-up; one test goes through `meshlm verify --nproc 2`
as a user types it.
"""

import io
import json
from functools import partial

import pytest

from dist import run_distributed
from meshlm import verify
from meshlm.cli import main as cli_main
from meshlm.config import load_config
from parity import FP64_TOL
from runs import TRAIN, train_config

STEPS = 3
SETTINGS = [*TRAIN, "train.global_batch_size=8", "train.lr=3e-3", "parallel.bucket_size_mb=0.02"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


make_cfg = partial(train_config, None, settings=SETTINGS)


def train_ranks(rank, world_size, cfg, double_gradients: bool):
    """One rank of the layout run, as `meshlm train` runs it; optionally with a planted bug."""
    from meshlm.train.trainer import Trainer

    if double_gradients:
        # Every gradient twice what it should be, the loss value unchanged -- what a gradient reduced
        # twice looks like, and a bug AdamW all but hides in the weights.
        loss_sum = Trainer.loss_sum
        Trainer.loss_sum = lambda self, logits, targets: (lambda s: s + (s - s.detach()))(
            loss_sum(self, logits, targets))
    Trainer(cfg).train()


def harness(*, double_gradients: bool = False):
    def launch(cfg, nproc):
        run_distributed(train_ranks, nproc, cfg, double_gradients, timeout=180)
    return launch


@pytest.mark.parametrize("nproc, layout, axes", [
    (2, ["train.micro_batch_size=2"], {"dp"}),  # plain DP, 2 micro-batches accumulated per rank
    (2, ["parallel.zero_stage=2"], {"dp_shard"}),  # ZeRO-2 over dp_shard=2
    (2, ["parallel.tp=2"], {"tp"}),  # tensor parallel with sequence parallelism
    (4, ["parallel.tp=2", "parallel.zero_stage=3"], {"dp_shard", "tp"}),  # TP x ZeRO-3 over dp_shard=2
], ids=["dp2", "zero2", "tp2", "tp2xzero3"])
def test_layouts_match_the_single_process_run_in_fp64(tmp_path, text_file, nproc, layout, axes):
    report = verify.run(make_cfg(text_file, *layout), nproc=nproc, steps=STEPS, run_dir=tmp_path,
                        launch=harness(), log=io.StringIO())
    assert report.ok, verify.format_report(report)
    assert [r.step for r in report.rows] == [1, 2, 3]
    assert max(max(r.loss[2], r.grad_norm[2]) for r in report.rows) <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL and report.num_tensors == 21
    assert set(report.comm_bytes) == axes and all(v > 0 for v in report.comm_bytes.values())
    assert all(r.comm_bytes == report.rows[0].comm_bytes for r in report.rows)  # the same traffic every step


def test_a_doubled_gradient_fails_and_the_table_shows_where(tmp_path, text_file):
    out = io.StringIO()
    code = verify.main(make_cfg(text_file), nproc=2, steps=STEPS, run_dir=tmp_path,
                       launch=harness(double_gradients=True), out=out, log=io.StringIO())
    text = out.getvalue()
    assert code == 1, text
    step1 = next(line for line in text.splitlines() if line.split()[:1] == ["1"])
    cells = step1.split()
    assert cells[3] != "nan" and float(cells[3]) <= FP64_TOL  # the first loss is right ...
    assert cells[6] == "1.0e+00!"  # ... the gradient norm twice the reference's
    verdict = text.strip().splitlines()[-1]
    assert verdict.startswith("verdict: MISMATCH") and "grad norm differs from step 1" in verdict, text


def test_cli_verify_through_the_elastic_launcher(tmp_path, text_file, capsys, monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    sets = [a for s in [*SETTINGS, f"data.path={text_file}"] for a in ("--set", s)]
    assert cli_main(["verify", "--nproc", "2", *sets, "--steps", "2", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout holds the JSON alone; progress went to stderr
    assert report["match"] and report["layout"].startswith("dp_shard=2,") and report["precision"] == "fp64"
    assert [r["step"] for r in report["rows"]] == [1, 2]
    assert report["weights"]["max_abs_diff"] <= FP64_TOL
    assert report["tolerance"] == {"loss_rel": 1e-9, "grad_norm_rel": 1e-9, "weights_abs": 1e-9}
    assert report["comm_bytes"]["dp"] > 0
    assert "meshlm verify: reference done" in captured.err
    assert list(tmp_path.iterdir()) == [], "a temporary run dir is removed after a match"


def test_bad_layout_exits_2_with_one_line_before_anything_runs(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert cli_main(["verify", "--nproc", "4", "--set", f"data.path={text_file}", "--set", "parallel.tp=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshlm verify: error: ") and "tp=3" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_help_lists_verify():
    from meshlm.cli import build_parser

    assert "meshlm verify --nproc" in build_parser().format_help()


def test_the_layout_config_file_reads_back_to_the_same_config(tmp_path, text_file):
    cfg = make_cfg(text_file, "model.preset=tiny-moe", "parallel.tp=2", "train.lr=1e-3",
                   'model.rope_scaling={factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, '
                   'original_max_position_embeddings = 64}')
    assert verify.write_config(cfg, tmp_path / "c.toml")  # asserts the round trip itself
    assert load_config(tmp_path / "c.toml").to_dict() == cfg.to_dict()
