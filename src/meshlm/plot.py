"""`meshlm plot`: the picture of one or more training runs, from their metrics.jsonl.

Responsible for: reading `<run_dir>/metrics.jsonl` of each run (rows a crash cut short are skipped), a
PNG with three panels -- training loss and validation loss per step (the runs overlaid, one colour
each, e.g. to compare layouts), tokens/s per step, and the communication share of each step (the
seconds every mesh axis spent in collectives, `comm_s`, over the step time) -- and a one-line summary
of each run. matplotlib is imported only here, only when a plot is drawn (the `plot` extra).
Not responsible for: any number that training did not log.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from meshlm.files import check_picture_path


@dataclass
class Run:
    path: Path
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    comm_share: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)

    def summary(self) -> str:
        val = f", val loss {self.val_loss[0]:.3f} -> {self.val_loss[-1]:.3f}" if self.val_loss else ""
        tps = sum(self.tokens_per_s) / len(self.tokens_per_s)
        comm = sum(self.comm_share) / len(self.comm_share)
        return (f"{self.path}: {len(self.steps)} steps, loss {self.loss[0]:.3f} -> {self.loss[-1]:.3f}{val}, "
                f"{tps:,.0f} tokens/s, {100 * comm:.0f}% of step time in communication")


def read_run(run_dir: str | Path) -> Run:
    """The curves of one run; ValueError (naming the directory and the fix) when it has none."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        what = "does not exist" if not path.exists() else "has no metrics.jsonl"
        raise ValueError(f"run directory {str(run_dir)!r} {what}; pass the train.run_dir of a `meshlm train` run "
                         "(e.g. runs/default)")
    run = Run(path=path)
    for number, line in enumerate(metrics.read_text(errors="replace").splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:  # a line a crash cut short (a resumed run appends after it)
            continue
        if not isinstance(row, dict):
            continue
        try:
            _add_row(run, row)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{metrics}:{number}: a row meshlm train does not write ({type(e).__name__}: {e}); "
                             "remove or mend that line") from None
    if not run.steps:
        raise ValueError(f"{metrics} holds no training step yet; plot a run that has logged at least one step")
    return run


def _add_row(run: Run, row: dict) -> None:
    """One metrics.jsonl row into the curves: a training step's (loss, tokens/s, communication) or a validation's."""
    if "loss" in row:
        step, loss = int(row["step"]), float(row["loss"])
        tokens_per_s = float(row.get("tokens_per_s", 0.0))
        step_time = float(row.get("step_time_s") or 0.0)
        comm = sum(float(v) for v in (row.get("comm_s") or {}).values())
        run.steps.append(step)
        run.loss.append(loss)
        run.tokens_per_s.append(tokens_per_s)
        run.comm_share.append(min(comm / step_time, 1.0) if step_time > 0 else 0.0)
    elif "val_loss" in row:
        step, loss = int(row["step"]), float(row["val_loss"])
        run.val_steps.append(step)
        run.val_loss.append(loss)


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> list[Run]:
    """Draw the runs into `out` (PNG, or any format matplotlib knows by the suffix); return them."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("meshlm plot needs matplotlib: pip install matplotlib (the plot extra: "
                         "pip install -e \".[plot]\")")
    out = check_picture_path(out, "--out", example="loss.png")
    runs = [read_run(d) for d in run_dirs]
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # Label runs by their directory name, or by the whole path where two names are the same.
    names = [r.path.name or str(r.path) for r in runs]
    labels = [str(r.path) if names.count(n) > 1 else n for r, n in zip(runs, names)]
    fig, (ax_loss, ax_speed, ax_comm) = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = plt.get_cmap("tab10")
    for i, (run, label) in enumerate(zip(runs, labels)):
        color = colors(i % 10)
        ax_loss.plot(run.steps, run.loss, color=color, label=f"{label} train")
        if run.val_loss:
            ax_loss.plot(run.val_steps, run.val_loss, color=color, linestyle="--", marker="o", markersize=3,
                         label=f"{label} val")
        ax_speed.plot(run.steps, run.tokens_per_s, color=color, label=label)
        ax_comm.plot(run.steps, [100 * c for c in run.comm_share], color=color, label=label)
    for ax, title, unit in ((ax_loss, "loss (solid: train, dashed: validation)", "loss"),
                            (ax_speed, "throughput", "tokens/s"),
                            (ax_comm, "communication share of each step", "% of step time")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    # at least 0-1 %: a run without communication draws a flat line at 0, not an axis of rounding noise
    ax_comm.set_ylim(0, max([1.0, *(110 * c for r in runs for c in r.comm_share)]))
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except ValueError as e:  # an unknown format suffix
        raise ValueError(f"--out {str(out)!r}: {e}; use a .png file") from None
    finally:
        plt.close(fig)
    return runs
