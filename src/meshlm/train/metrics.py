"""Training metrics: model FLOPs, MFU, memory, a `metrics.jsonl` per run, a progress bar, trackers.

Responsible for: a simple analytic FLOPs-per-token estimate (the planner has the exact cost model),
a guess of a device's peak bf16 TFLOP/s when none is configured, peak memory of this process, and
`MetricsLogger`, which appends one JSON object per logged step to `<run_dir>/metrics.jsonl`, drives a
rich progress bar (rank 0 only; both can be turned off) and, when asked (train.tensorboard,
train.wandb), sends the same numbers to TensorBoard event files in `<run_dir>` and to an offline
Weights & Biases run in `<run_dir>/wandb` (`tracker_scalars` names them).
Not responsible for: reducing metrics across ranks (the trainer passes values already reduced), or
installing the trackers: a missing package is a one-line error naming the pip command.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
from pathlib import Path

import torch


# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s per device; matched against the device name.
_PEAK_TFLOPS = (("B200", 2250.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0))
_CUDA_UNKNOWN_TFLOPS = 100.0
# A nominal figure for a few CPU cores in fp32: MFU on CPU is only a relative number.


def peak_tflops_guess(device: torch.device) -> tuple[float | None, str]:
    """(peak TFLOP/s per device, how it was obtained) for MFU when train.peak_tflops is 0; None on CPU,
    whose peak meshlm cannot know (MFU is then not reported: tokens/s is the measure)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _PEAK_TFLOPS:
            if key in name:
                return value, f"{name}: {value:g} TFLOP/s bf16 dense"
        return _CUDA_UNKNOWN_TFLOPS, f"{name} is not in the table: assuming {_CUDA_UNKNOWN_TFLOPS:g} TFLOP/s"
    return None, "not shown on CPU (needs train.peak_tflops)"


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: allocated tensors on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl row; infinity for a line that is not a whole JSON object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return float("inf")
    return row.get("step", 0) if isinstance(row, dict) else float("inf")


LINE_WIDTH = 80  # the step line of log files (no terminal to ask): it fits a classic terminal
BAR_WIDTH = 12  # cells of the progress bar itself; the numbers next to it matter more


def _count(value: float) -> str:
    """1234 -> "1,234", 37012 -> "37.0k", 2.5e6 -> "2.50M": at most 6 characters for any rate."""
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:,.0f}"


def step_info(row: dict, width: int) -> str:
    """The numbers of a step row, most important first (loss, tokens/s, lr, grad norm, MFU, memory,
    activations), as many as fit in `width` characters: the bar and the step line never wrap or get cut."""
    mem = row.get("memory_mib") or 0.0
    parts = [f"loss {row['loss']:.4f}", f"{_count(row['tokens_per_s'])} tok/s", f"lr {row['lr']:.1e}",
             f"grad {row['grad_norm']:.3g}"]
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    parts.append(f"mem {mem / 1024:.1f} GiB" if mem >= 10 * 1024 else f"mem {mem:,.0f} MiB")
    if row.get("activation_mib"):
        parts.append(f"act {row['activation_mib']:,.1f} MiB")
    text = parts[0]
    for part in parts[1:]:
        if len(text) + 2 + len(part) > width:
            break
        text += "  " + part
    return text


def check_trackers(*, tensorboard: bool, wandb: bool) -> None:
    """Raise ValueError (one line, the pip command) when a tracker the config asks for is not installed."""
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("train.tensorboard=true needs the tensorboard package: pip install tensorboard (the tb extra: "
                         "pip install -e \".[tb]\"), or set train.tensorboard=false")
    if wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("train.wandb=true needs the wandb package: pip install wandb, or set train.wandb=false")


def tracker_scalars(row: dict) -> dict[str, float]:
    """The scalars of a metrics.jsonl row as tracker tags: a step's numbers under `train/` (loss, lr,
    grad_norm, tokens_per_s, mfu, memory_mib, ...), a validation row's as `val/loss`, and each per-axis
    table as `<name>/<axis>` (`comm_mb/dp`, `comm_s/tp`, `expert_load/imbalance`). None (e.g. MFU on CPU)
    and the step itself are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "step" or value is None or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out["val/loss" if key == "val_loss" else f"train/{key}"] = float(value)
        elif isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def remove_tracker_files(run_dir: str | Path) -> None:
    """A fresh run's start: the TensorBoard event files an earlier run left in `run_dir` (metrics.jsonl
    goes the same way), so the charts show this run only."""
    for f in Path(run_dir).glob("events.out.tfevents.*"):
        f.unlink(missing_ok=True)


class MetricsLogger:
    """Appends rows to `<run_dir>/metrics.jsonl` and shows a progress bar; a no-op when not enabled.

    `enabled` is true on the rank that logs (rank 0); every other rank constructs it disabled.
    `start_step > 0` (a resumed run) first drops rows logged after that step by the interrupted run.
    """

    def __init__(self, run_dir: str | Path, *, total_steps: int, enabled: bool = True,
                 progress: bool = True, start_step: int = 0, tensorboard: bool = False,
                 wandb_config: dict | None = None, console=None):
        """`tensorboard`: also write TensorBoard event files into `run_dir`; `wandb_config`: also log to an
        offline W&B run (in `run_dir/wandb`) with this config; `console`: the rich Console the bar draws
        on (default: the terminal)."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._progress = None
        self._tensorboard = None
        self._wandb = None
        if not enabled:
            return
        check_trackers(tensorboard=tensorboard, wandb=wandb_config is not None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step > 0 and self.path.exists():
            # Resuming: rows a crashed run logged after its last checkpoint are about to be redone
            # (and a row the crash cut short is dropped).
            rows = [line for line in self.path.read_text().splitlines() if _step_of(line) <= start_step]
            self.path.write_text("".join(r + "\n" for r in rows))
        self._file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run's charts drop what the interrupted run logged after its checkpoint,
            # as metrics.jsonl does above.
            self._tensorboard = SummaryWriter(log_dir=str(self.path.parent),
                                              purge_step=start_step + 1 if start_step > 0 else None)
        if wandb_config is not None:
            import wandb

            # Offline: works without network or account; `wandb sync <run_dir>/wandb/offline-run-*` uploads.
            self._wandb = wandb.init(project="meshlm", name=self.path.parent.name, dir=str(self.path.parent),
                                     config=wandb_config, mode="offline")
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(bar_width=BAR_WIDTH), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def log(self, row: dict) -> None:
        """Write one row (a step's metrics, or a validation row with `val_loss`)."""
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tensorboard is not None or self._wandb is not None:
            scalars = tracker_scalars(row)
            for tag, value in scalars.items():
                if self._tensorboard is not None:
                    self._tensorboard.add_scalar(tag, value, global_step=row.get("step", 0))
            if self._wandb is not None and scalars:
                self._wandb.log(scalars, step=row.get("step", 0))
        if "loss" in row:
            if self._progress is not None:
                # What the other columns leave of the console's width (one space between columns).
                steps = len(f"{self.total_steps}") * 2 + 1
                room = self._progress.console.width - (len("train") + BAR_WIDTH + steps + len("0:00:00") + 4 + 1)
                self._progress.update(self._task, completed=row["step"], info=step_info(row, max(room, 20)))
            else:  # no bar: one plain line per logged step, for log files and batch jobs
                head = f"step {row['step']}/{self.total_steps}"
                print(f"{head}  {step_info(row, LINE_WIDTH - len(head) - 2)}", flush=True)
        if "val_loss" in row:
            self.print(f"step {row['step']}: val_loss {row['val_loss']:.4f}")

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
