"""What a newcomer sees in a terminal: the progress bar and the plain step line fit 80 columns with the loss
first, and a layout wider than the world gets the same one-line advice from one process and from --nproc."""

import io

import pytest
from rich.console import Console

from meshlm.cli import main
from meshlm.train.metrics import MetricsLogger

ROW = {"step": 3, "loss": 5.5434, "lr": 2.4e-4, "grad_norm": 1.433, "tokens_per_s": 36999.0, "mfu": 0.451,
       "memory_mib": 322.0, "activation_mib": 1.25}
BIG = {**ROW, "step": 99999, "tokens_per_s": 12_345_678.0, "grad_norm": 123456.0, "memory_mib": 81_000.0}


@pytest.mark.parametrize("row, total", [(ROW, 150), (BIG, 100000)])
def test_the_progress_bar_fits_80_columns(tmp_path, row, total):
    console = Console(width=80, file=io.StringIO(), force_terminal=False, record=True)
    logger = MetricsLogger(tmp_path, total_steps=total, console=console)
    logger.log(row)
    logger.close()
    lines = [line for line in console.export_text().splitlines() if line.strip()]
    assert len(lines) == 1 and len(lines[0]) <= 80, lines  # one line, nothing wrapped
    assert lines[0].startswith("train ") and f"{row['step']}/{total}" in lines[0]
    assert f"loss {row['loss']:.4f}" in lines[0] and "tok/s" in lines[0], lines  # not cut to "t… loss…"
    wide = Console(width=160, file=io.StringIO(), force_terminal=False, record=True)
    logger = MetricsLogger(tmp_path, total_steps=total, console=wide)
    logger.log(row)
    logger.close()
    assert "MFU 45.1%" in wide.export_text()  # a wider terminal shows everything


@pytest.mark.parametrize("row, total", [(ROW, 150), (BIG, 100000)])
def test_the_plain_step_line_fits_80_columns(tmp_path, capsys, row, total):
    logger = MetricsLogger(tmp_path, total_steps=total, progress=False)
    logger.log(row)
    logger.close()
    line, = capsys.readouterr().out.splitlines()
    assert len(line) <= 80 and line.startswith(f"step {row['step']}/{total}  loss {row['loss']:.4f}  "), line


def test_a_layout_wider_than_the_world_gets_one_message(capsys):
    assert main(["train", "--set", "parallel.pp=2"]) == 2
    single = capsys.readouterr().err.strip().splitlines()
    assert main(["train", "--nproc", "2", "--set", "parallel.pp=4"]) == 2  # refused before any rank starts
    launched = capsys.readouterr().err.strip().splitlines()
    assert single == ["meshlm train: error: pp=2 x dp_replicate=1 x cp=1 x tp=1 = 2 does not divide world size 1; "
                      "choose pp in {1}; or start 2 ranks (or a multiple), e.g. --nproc 2"], single
    assert launched == ["meshlm train: error: pp=4 x dp_replicate=1 x cp=1 x tp=1 = 4 does not divide world size 2; "
                        "choose pp in {1,2}; or start 4 ranks (or a multiple), e.g. --nproc 4"], launched
