"""`meshlm verify`: prove a parallel layout against the single-process run of the same config.

Responsible for: turning one config into two runs of `train.steps = S` steps from the same seed and
data -- the layout as asked for on `nproc` ranks, and the reference with the parallel section reset to
its defaults on one process -- each in its own run directory with only a final checkpoint; then
comparing, step by step, the loss and the gradient norm (from each run's `metrics.jsonl`), the final
weights tensor by tensor (read back from the two checkpoints, which hold full unsharded tensors
whatever the layout), and reporting what every mesh axis moved (the layout's per-step `comm_mb`);
a verdict and an exit code (0 all match, 1 something does not or the layout run failed; a layout that
cannot run at all raises ValueError before any rank starts, which the CLI turns into exit code 2).
Not responsible for: training or launching -- the reference is `Trainer(cfg).train()` in this process
and the layout run is `meshlm train --nproc N` (torch's elastic launcher) in a subprocess, so every
layout the trainer accepts is verifiable the day it lands, with no change here.

Precision. `precision="fp64"` (the default) trains both runs entirely in float64, where any two correct
layouts agree to ~1e-15: losses and grad norms must agree to 1e-9 (relative) and final weights to 1e-9
(absolute), a verdict that holds on any machine. `precision="fp32"` runs the real dtype: losses and grad
norms are checked at 1e-5 (relative), and the weight difference is reported but not judged, since after a
few AdamW steps fp32 weights differ by ~1e-5 depending on the machine's summation order.

The launch seam. `run(..., launch=fn)` replaces how the layout's ranks are started: `fn(cfg, nproc)`
must train `cfg` (`train.run_dir` already points at the layout's run directory) on `nproc` ranks, e.g.
each rank calling `Trainer(cfg).train()` under a default process group, and raise if that failed. The
default, `elastic_launch`, writes `cfg` to `<run_dir>/config.toml` and runs `meshlm train --nproc N
--config <run_dir>/config.toml` (the exact user path). Tests pass one that starts ranks through their
own harness -- faster than the elastic launcher, and able to plant a bug (e.g. gradients doubled) in the
ranks only, to prove that verify fails when it should. There is no environment variable or config
field for that: a wrong layout is reachable only from Python.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, TextIO

from meshlm.config import Config, ParallelConfig, load_config
from meshlm.config_doc import toml_value

Launch = Callable[[Config, int], None]

PRECISIONS = ("fp64", "fp32")
# (losses and grad norms: relative; weights: absolute, or None = reported, not judged)
TOLERANCES = {"fp64": (1e-9, 1e-9), "fp32": (1e-5, None)}
DEFAULT_STEPS = 5
MAX_STEPS = 1000  # the longest run verify compares (--steps)


class LaunchFailed(RuntimeError):
    """The layout's ranks did not finish: `code` is the launcher's exit code, `log` where its output is."""

    def __init__(self, message: str, *, code: int, log: Path | None = None):
        super().__init__(message)
        self.code, self.log = code, log


# --------------------------------------------------------------------------------------------
# The two configs
# --------------------------------------------------------------------------------------------


def prepare(cfg: Config, *, steps: int, precision: str, run_dir: str | Path) -> Config:
    """A copy of `cfg` that trains `steps` steps in `precision` into `run_dir`: no validation, no sample,
    no progress bar, every step logged, one checkpoint at the end."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {list(PRECISIONS)} (fp64: exact proof; "
                         "fp32: the real dtype, weights reported only)")
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"--steps={steps} must be in 1..{MAX_STEPS}: verify proves a layout step by step over a "
                         "short run; train longer with meshlm train")
    cfg = copy.deepcopy(cfg)
    t = cfg.train
    t.steps, t.epochs, t.precision, t.run_dir = steps, 0.0, precision, str(run_dir)  # the steps asked, not epochs
    t.val_batches, t.sample_tokens, t.progress = 0, 0, False
    t.log_interval, t.checkpoint_interval, t.keep_checkpoints = 1, 0, 1
    return cfg.validate()


def reference_config(cfg: Config, *, run_dir: str | Path, micro_batch_size: int | None = None) -> Config:
    """The same config on one process: the parallel section back to its defaults, and the layout's micro-batch
    size (`micro_batch_size`, when the config leaves it to the layout: train.micro_batch_size = 0). The
    micro-batches must be the same: a MoE load-balancing loss is a mean over each micro-batch's tokens, so
    one micro-batch of the whole batch is another loss than the mean over dp micro-batches of it."""
    ref = copy.deepcopy(cfg)
    ref.parallel = ParallelConfig()
    ref.train.run_dir = str(run_dir)
    if micro_batch_size is not None and not ref.train.micro_batch_size:
        ref.train.micro_batch_size = micro_batch_size
    return ref.validate()


def describe_layout(cfg: Config, world_size: int) -> str:
    """e.g. "dp_shard=2, tp=2, zero_stage=3": the resolved degrees above 1, then every other parallel
    setting that differs from its default (so new knobs show up without a change here)."""
    from meshlm.mesh import AXES
    from meshlm.parallel.parallelize import check_layout

    dims = check_layout(cfg, world_size)
    parts = [f"{a}={dims.degree(a)}" for a in AXES if dims.degree(a) > 1]
    if dims.ep > 1:
        parts.append(f"ep={dims.ep}")
    degrees = {"dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"}
    default = ParallelConfig()
    for f in fields(ParallelConfig):
        value = getattr(cfg.parallel, f.name)
        if f.name not in degrees and value != getattr(default, f.name):
            parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    return ", ".join(parts) or "1 process"


def config_toml(cfg: Config) -> str:
    """`cfg` as a TOML file that `load_config` reads back to the same config (checked)."""
    lines = ["# written by `meshlm verify`: rerun with `meshlm train --config <this file>`"]
    for section, values in cfg.to_dict().items():
        lines.append(f"\n[{section}]")
        # None is TOML-less: such a field is left out and takes its default (checked below).
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


def write_config(cfg: Config, path: Path) -> Path:
    path.write_text(config_toml(cfg))
    assert load_config(path).to_dict() == cfg.to_dict(), f"{path} does not read back to the same config"
    return path


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def elastic_launch(cfg: Config, nproc: int) -> None:
    """The default launch: `meshlm train --nproc N --config <run_dir>/config.toml` in a subprocess,
    its output in `<run_dir>/train.log`. Raises ValueError (the ranks' one-line error) when they exit 2
    on a user mistake, LaunchFailed on any other failure."""
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = write_config(cfg, run_dir / "config.toml")
    log = run_dir / "train.log"
    command = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", str(nproc), "--config", str(config)]
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if code == 0:
        return
    text = log.read_text(errors="replace").strip().splitlines()
    errors = [line for line in text if line.startswith("meshlm train: error: ")]
    if code == 2 and errors:
        raise ValueError(errors[-1][len("meshlm train: error: "):])
    tail = "\n".join(text[-30:])
    raise LaunchFailed(f"`{' '.join(command[1:])}` exited with code {code}; the end of {log}:\n{tail}",
                       code=code, log=log)


def run_reference(cfg: Config) -> None:
    """Train `cfg` on this process (no process group), its output in `<run_dir>/train.log`."""
    from meshlm.train.trainer import Trainer

    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.log", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        trainer = Trainer(cfg)
        trainer.train()
        del trainer


def final_weights(run_dir: str | Path) -> dict:
    """The model state of a run's latest checkpoint, in the dtype it was trained in (full tensors)."""
    from meshlm.models import build_model
    from meshlm.checkpoint import config_from_dict, latest_checkpoint, load_weights, read_meta
    from meshlm.train.setup import param_dtype

    path = latest_checkpoint(run_dir)
    if path is None:
        raise LaunchFailed(f"{run_dir} has no checkpoint: the run did not finish", code=1)
    cfg = config_from_dict(read_meta(path)["config"])
    model = build_model(cfg.model, seed=cfg.train.seed, dtype=param_dtype(cfg.train.precision))
    load_weights(path, model)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _step_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


# --------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    step: int
    loss: tuple[float, float, float]  # reference, layout, relative difference
    grad_norm: tuple[float, float, float]
    comm_bytes: dict[str, int]  # what each mesh axis moved on the layout, this step


@dataclass
class Report:
    nproc: int
    layout: str
    precision: str
    steps: int
    rel_tol: float
    weight_tol: float | None  # None: weights reported, not judged (fp32)
    run_dir: str
    rows: list[StepResult] = field(default_factory=list)
    max_weight_diff: float = float("nan")
    max_weight_tensor: str = ""
    num_tensors: int = 0
    failures: list[str] = field(default_factory=list)  # what did not match, in the order found
    matched: list[str] = field(default_factory=list)  # what did

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def comm_bytes(self) -> dict[str, int]:
        """Bytes each mesh axis moved over the whole run."""
        total: dict[str, int] = {}
        for row in self.rows:
            for axis, n in row.comm_bytes.items():
                total[axis] = total.get(axis, 0) + n
        return total

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = [{"step": r.step,
                      "loss": dict(zip(("reference", "layout", "rel_diff"), r.loss)),
                      "grad_norm": dict(zip(("reference", "layout", "rel_diff"), r.grad_norm)),
                      "comm_bytes": r.comm_bytes} for r in self.rows]
        d["weights"] = {"max_abs_diff": d.pop("max_weight_diff"), "tensor": d.pop("max_weight_tensor"),
                        "num_tensors": d.pop("num_tensors")}
        d["tolerance"] = {"loss_rel": d.pop("rel_tol"), "grad_norm_rel": self.rel_tol,
                          "weights_abs": d.pop("weight_tol")}
        d["comm_bytes"] = self.comm_bytes
        d["match"] = self.ok
        return d


def rel_diff(reference: float, other: float) -> float:
    if reference == other:  # both 0 (or the same infinity)
        return 0.0
    return abs(other - reference) / abs(reference) if reference else math.inf


def compare(report: Report, ref_dir: Path, layout_dir: Path) -> Report:
    """Fill `report` with the per-step and final-weight comparison of the two finished runs."""
    ref_rows, lay_rows = _step_rows(ref_dir), _step_rows(layout_dir)
    tol = report.rel_tol
    first_bad = {}
    for want, got in zip(ref_rows, lay_rows):
        loss = (want["loss"], got["loss"], rel_diff(want["loss"], got["loss"]))
        norm = (want["grad_norm"], got["grad_norm"], rel_diff(want["grad_norm"], got["grad_norm"]))
        comm = {axis: round(mb * 2**20) for axis, mb in got.get("comm_mb", {}).items()}
        report.rows.append(StepResult(step=got["step"], loss=loss, grad_norm=norm, comm_bytes=comm))
        for what, (_, _, diff) in (("loss", loss), ("grad norm", norm)):
            if not diff <= tol and what not in first_bad:  # `not <=`: a NaN fails too
                first_bad[what] = f"{what} differs from step {got['step']} on (relative difference {diff:.1e} > {tol:g})"
    report.failures += [first_bad[w] for w in ("loss", "grad norm") if w in first_bad]
    report.matched += [f"{w}es" if w == "loss" else f"{w}s" for w in ("loss", "grad norm") if w not in first_bad]
    if len(ref_rows) != report.steps or len(lay_rows) != report.steps:
        report.failures.append(f"expected {report.steps} logged steps, got {len(ref_rows)} (reference) and "
                               f"{len(lay_rows)} (layout)")

    want, got = final_weights(ref_dir), final_weights(layout_dir)
    if set(want) != set(got):
        report.failures.append(f"the checkpoints hold different tensors: only in the reference "
                               f"{sorted(set(want) - set(got))}, only in the layout {sorted(set(got) - set(want))}")
    worst, worst_name = -1.0, ""
    for name in sorted(set(want) & set(got)):
        if want[name].shape != got[name].shape:
            report.failures.append(f"weights: {name} has shape {tuple(got[name].shape)}, the reference "
                                   f"{tuple(want[name].shape)}")
            continue
        diff = float((got[name].double() - want[name].double()).abs().max()) if want[name].numel() else 0.0
        if not diff <= worst:  # the first NaN wins
            worst, worst_name = diff, name
            if math.isnan(diff):
                break
    report.max_weight_diff, report.max_weight_tensor = worst, worst_name
    report.num_tensors = len(set(want) & set(got))
    if report.weight_tol is None:
        pass  # fp32: reported, not judged
    elif worst <= report.weight_tol:
        report.matched.append("final weights")
    else:
        report.failures.append(f"final weights differ: max |difference| {worst:.1e} in {worst_name} "
                               f"> {report.weight_tol:g}")
    return report


# --------------------------------------------------------------------------------------------
# The whole command
# --------------------------------------------------------------------------------------------


def check(cfg: Config, *, nproc: int, steps: int, precision: str) -> None:
    """Raise ValueError if verify cannot run this (the layout, or its one-process reference)."""
    from meshlm.parallel.parallelize import check_layout

    if nproc < 1:
        raise ValueError(f"--nproc={nproc} must be >= 1")
    layout_cfg = prepare(cfg, steps=steps, precision=precision, run_dir=cfg.train.run_dir)
    check_layout(layout_cfg, nproc)  # the same one-line error as `meshlm train --nproc`
    check_layout(reference_config(layout_cfg, run_dir=cfg.train.run_dir), 1)


def run(cfg: Config, *, nproc: int, steps: int = DEFAULT_STEPS, precision: str = "fp64",
        run_dir: str | Path | None = None, launch: Launch | None = None,
        log: TextIO | None = None) -> Report:
    """Run the reference and the layout of `cfg` on `nproc` ranks for `steps` steps; compare them.

    A layout that cannot run raises ValueError before anything starts. `run_dir` holds `reference/` and
    `layout/` (default: a new temporary directory, whose path the report carries). `launch` starts the
    layout's ranks (default `elastic_launch`; see the module docstring). Progress goes to `log`
    (default stderr). A failed layout run raises LaunchFailed (or what `launch` raises).
    """
    log = sys.stderr if log is None else log
    check(cfg, nproc=nproc, steps=steps, precision=precision)  # before any work or directory
    root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="meshlm-verify-"))
    root.mkdir(parents=True, exist_ok=True)  # a file in the way is one line here, before anything is said or run
    layout_cfg = prepare(cfg, steps=steps, precision=precision, run_dir=root / "layout")
    from meshlm.parallel.parallelize import check_layout, micro_batch_size

    dp = check_layout(layout_cfg, nproc).dp
    ref_cfg = reference_config(layout_cfg, run_dir=root / "reference",
                               micro_batch_size=micro_batch_size(layout_cfg, dp))
    rel_tol, weight_tol = TOLERANCES[precision]
    report = Report(nproc=nproc, layout=describe_layout(layout_cfg, nproc), precision=precision, steps=steps,
                    rel_tol=rel_tol, weight_tol=weight_tol, run_dir=str(root))

    def say(text: str) -> None:
        print(f"meshlm verify: {text}", file=log, flush=True)

    say(f"{nproc} ranks ({report.layout}) against 1 process, {steps} steps in {precision}; runs in {root}")
    # The layout first: what only its ranks can refuse (e.g. more ranks than GPUs) fails before the
    # reference costs anything, and the reference's device memory is not held while the ranks run.
    start = time.perf_counter()
    (launch or elastic_launch)(layout_cfg, nproc)
    say(f"layout done in {time.perf_counter() - start:.1f} s (log: {root / 'layout' / 'train.log'})")
    start = time.perf_counter()
    run_reference(ref_cfg)
    say(f"reference done in {time.perf_counter() - start:.1f} s (log: {root / 'reference' / 'train.log'})")
    return compare(report, root / "reference", root / "layout")


def format_report(r: Report) -> str:
    """The human-readable table and verdict."""
    axes = sorted({a for row in r.rows for a in row.comm_bytes})
    weights = (f"weights {r.weight_tol:g} absolute" if r.weight_tol is not None
               else "weights reported, not judged (fp32 AdamW updates differ by ~1e-5 between machines)")
    lines = [f"meshlm verify: {r.nproc} ranks ({r.layout}) vs 1 process, {r.steps} steps, {r.precision}",
             f"tolerance: loss and grad norm {r.rel_tol:g} relative; {weights}", ""]
    head = (f"{'step':>4}  {'loss ref':>16} {'loss layout':>16} {'rel diff':>8}  "
            f"{'grad norm ref':>16} {'grad norm layout':>16} {'rel diff':>8}"
            + "".join(f"  {a + ' MiB':>12}" for a in axes))
    lines += [head, "-" * len(head)]
    for row in r.rows:
        (lr, ll, ld), (gr, gl, gd) = row.loss, row.grad_norm
        mark = lambda d: f"{d:>8.1e}" if d <= r.rel_tol else f"{d:>7.1e}!"  # noqa: E731
        lines.append(f"{row.step:>4}  {lr:>16.12f} {ll:>16.12f} {mark(ld)}  {gr:>16.12f} {gl:>16.12f} {mark(gd)}"
                     + "".join(f"  {row.comm_bytes.get(a, 0) / 2**20:>12.4f}" for a in axes))
    lines.append("")
    over = ("  (reported, not judged)" if r.weight_tol is None
            else "" if r.max_weight_diff <= r.weight_tol else "  (over tolerance)")
    lines.append(f"final weights: max |difference| {r.max_weight_diff:.1e} in {r.max_weight_tensor} "
                 f"({r.num_tensors} tensors compared){over}")
    totals = r.comm_bytes
    moved = ", ".join(f"{a} {totals[a]:,} bytes ({totals[a] / max(len(r.rows), 1) / 2**20:.4f} MiB/step)"
                      for a in axes)
    lines.append(f"communication of the layout: {moved or 'none'}")
    if axes and r.precision == "fp64":
        lines[-1] += " (fp64: twice the bytes of the same run in fp32)"
    matched = " and ".join(", ".join(r.matched).rsplit(", ", 1))
    if r.ok:
        lines.append(f"verdict: MATCH -- {matched} of all {r.steps} steps agree within tolerance")
    else:
        lines.append("verdict: MISMATCH -- " + "; ".join(r.failures)
                     + (f"; {matched} match" if r.matched else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Every layout (`meshlm verify --all-layouts`)
# --------------------------------------------------------------------------------------------

# The batch of the enumeration: every dp up to 4 divides it (micro-batches of 2), seq 64 splits over cp x tp up to 8.
ALL_LAYOUTS_DEFAULTS = ["train.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_degrees(cfg: Config, degrees: dict[str, int]) -> Config:
    """A copy of `cfg` with these parallel degrees (the other parallel settings as they are)."""
    out = copy.deepcopy(cfg)
    for key, value in degrees.items():
        setattr(out.parallel, key, value)
    return out


def all_layouts(cfg: Config, *, max_ranks: int) -> tuple[list[tuple[int, dict[str, int]]], dict[str, int]]:
    """Every (dp_replicate, dp_shard, tp, pp, cp, ep, zero_stage) of 2..`max_ranks` ranks for `cfg`'s model
    and batch (ep > 1 only for a MoE model), the rest of `cfg.parallel` as it is: ([(ranks, degrees)] that
    `check_layout` accepts, {a kind of refusal, its numbers written N: how many layouts got it})."""
    from meshlm.parallel.parallelize import check_layout

    accepted, refused = [], {}
    experts = cfg.model.num_experts if cfg.model.is_moe else 1
    for world in range(2, max_ranks + 1):
        for dp_replicate, tp, pp, cp in ((r, t, p, c) for r in _divisors(world) for t in _divisors(world)
                                         for p in _divisors(world) for c in _divisors(world)):
            if world % (dp_replicate * tp * pp * cp):
                continue
            dp_shard = world // (dp_replicate * tp * pp * cp)
            for ep in (e for e in _divisors(experts) if e <= world):
                for zero_stage in (0, 1, 2, 3):
                    degrees = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep,
                                   zero_stage=zero_stage)
                    try:
                        check_layout(with_degrees(cfg, degrees), world)
                    except ValueError as e:
                        # one entry per kind of refusal: the numbers (which differ layout to layout) as N
                        reason = re.sub(r"\d+", "N", str(e).split(";")[0].split(" (")[0])
                        refused[reason] = refused.get(reason, 0) + 1
                        continue
                    accepted.append((world, degrees))
    return accepted, refused


def layout_name(degrees: dict[str, int]) -> str:
    """`dp_shard=2 tp=2 zero_stage=3`: the degrees that are not 1 (zero_stage: not 0); `dp_shard=1` alone."""
    parts = [f"{k}={v}" for k, v in degrees.items() if v != (0 if k == "zero_stage" else 1)]
    return " ".join(parts) or "dp_shard=1"


def main_all_layouts(cfg: Config, *, max_ranks: int, sample: int = 0, seed: int = 0, steps: int = DEFAULT_STEPS,
                     precision: str = "fp64", launch: Launch | None = None, out: TextIO | None = None,
                     log: TextIO | None = None) -> int:
    """`meshlm verify --all-layouts`: verify every layout `all_layouts` accepts (or `sample` of them, drawn
    with `seed`), one line each, then a summary; exit code 0 when every one matched, else 1."""
    import random

    out = sys.stdout if out is None else out
    accepted, refused = all_layouts(cfg, max_ranks=max_ranks)
    chosen = accepted if not sample or sample >= len(accepted) else sorted(
        random.Random(seed).sample(accepted, sample), key=lambda a: (a[0], list(a[1].values())))
    print(f"meshlm verify --all-layouts: {len(accepted)} layouts of 2..{max_ranks} ranks run "
          f"({sum(refused.values())} combinations refused); verifying {len(chosen)}, {steps} steps in {precision}",
          file=out, flush=True)
    counts = {"MATCH": 0, "MISMATCH": 0, "FAILED": 0}
    for world, degrees in chosen:
        layout = with_degrees(cfg, degrees)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="meshlm-verify-") as root, open(Path(root) / "verify.log", "w") as own:
            try:
                r = run(layout, nproc=world, steps=steps, precision=precision, run_dir=root, launch=launch,
                        log=log if log is not None else own)
            except (LaunchFailed, RuntimeError) as e:
                counts["FAILED"] += 1
                print(f"{world} ranks  {layout_name(degrees):<52} FAILED  {str(e).splitlines()[0][:80]}",
                      file=out, flush=True)
                continue
        verdict = "MATCH" if r.ok else "MISMATCH"
        counts[verdict] += 1
        diff = max((max(row.loss[2], row.grad_norm[2]) for row in r.rows), default=math.nan)
        print(f"{world} ranks  {layout_name(degrees):<52} {verdict:<8} loss/grad {diff:.1e}  "
              f"weights {r.max_weight_diff:.1e}  {time.perf_counter() - start:.1f} s", file=out, flush=True)
    print(f"summary: {len(chosen)} verified: {counts['MATCH']} MATCH, {counts['MISMATCH']} MISMATCH, "
          f"{counts['FAILED']} failed", file=out)
    for reason, n in sorted(refused.items(), key=lambda kv: -kv[1]):
        print(f"  refused {n:>4}: {reason[:150]}", file=out)
    return 0 if counts["MATCH"] == len(chosen) else 1


def main(cfg: Config, *, nproc: int, steps: int = DEFAULT_STEPS, precision: str = "fp64",
         run_dir: str | Path | None = None, as_json: bool = False, launch: Launch | None = None,
         out: TextIO | None = None, log: TextIO | None = None) -> int:
    """`meshlm verify`: run, print the table (or JSON) to `out`, and return the exit code: 0 everything
    matched, 1 something did not (or the layout run failed). A layout that cannot run raises ValueError.

    Without `run_dir` the runs go to a temporary directory, removed when everything matched and kept
    (and named) otherwise.
    """
    out = sys.stdout if out is None else out
    log = sys.stderr if log is None else log
    check(cfg, nproc=nproc, steps=steps, precision=precision)  # a bad layout: no directory made
    keep = run_dir is not None
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="meshlm-verify-")
    try:
        report = run(cfg, nproc=nproc, steps=steps, precision=precision, run_dir=run_dir, launch=launch, log=log)
    except LaunchFailed as e:
        print(f"meshlm verify: the layout run failed: {e}\nmeshlm verify: runs kept in {run_dir}", file=log)
        return 1
    except BaseException:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if as_json:
        print(json.dumps(report.to_dict(), indent=1), file=out)
    else:
        print(format_report(report), file=out)
    if not keep:
        if report.ok:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"meshlm verify: runs kept in {run_dir} (reference/ and layout/: metrics.jsonl, train.log, "
                  "checkpoints)", file=log)
    return 0 if report.ok else 1
