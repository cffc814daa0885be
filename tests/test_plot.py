"""`meshlm plot`: a PNG of several runs from their metrics.jsonl, and one-line errors (exit 2) for a bad run
directory or a missing matplotlib."""

import importlib.util
import json

import pytest

from meshlm.cli import main
from meshlm.plot import read_run


def write_run(run_dir, *, comm: bool):
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "val_loss": 5.5}]
    for step in range(1, 6):
        rows.append({"step": step, "loss": 5.0 - 0.5 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + step,
                     "step_time_s": 0.5, "comm_mb": {"dp": 1.0} if comm else {},
                     "comm_s": {"dp": 0.1, "tp": 0.05} if comm else {}})
    rows.append({"step": 5, "val_loss": 3.0})
    lines = [json.dumps(r) for r in rows] + ['{"step": 6, "lo']  # a crash cut the last line short
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_plot_writes_a_png_of_the_runs_overlaid(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the [plot] extra (matplotlib) is not installed")
    a, b = write_run(tmp_path / "dp2", comm=True), write_run(tmp_path / "single", comm=False)
    out = tmp_path / "compare.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"wrote {out}: loss and validation loss, tokens/s and communication share of 2 run(s)"
    assert lines[1] == (f"  {a}: 5 steps, loss 4.500 -> 2.500, val loss 5.500 -> 3.000, 1,003 tokens/s, "
                        "30% of step time in communication")
    assert lines[2].endswith("0% of step time in communication")


def test_read_run_skips_the_cut_line_and_computes_the_comm_share(tmp_path):
    run = read_run(write_run(tmp_path / "r", comm=True))
    assert run.steps == [1, 2, 3, 4, 5] and run.val_steps == [0, 5]
    assert run.comm_share == pytest.approx([0.3] * 5)


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing", "does not exist; pass the train.run_dir of a `meshlm train` run"),
    (lambda p: p, "has no metrics.jsonl"),
])
def test_a_bad_run_dir_is_one_line_and_exit_2(tmp_path, capsys, make, expected):
    assert main(["plot", str(make(tmp_path)), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshlm plot: error: run directory") and expected in err[0], err
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["plot", str(write_run(tmp_path / "r", comm=False)), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install matplotlib" in err[0], err
