"""PNGs: the top layouts' memory per GPU and step time as stacked components; scaling curves; one long context's
memory per GPU against its length and TPOT against GPUs; serving deployments' throughput against interactivity; the
planner's error on published runs, group by group.

Responsible for: drawing (matplotlib, imported only here and only when a plot is asked for).
Not responsible for: any number.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from meshlm.planner.cost import Estimate

MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "comm_buffers", "fragmentation", "reserved")
TIME_PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_bubble", "pp_p2p", "dp_comm",
              "optimizer")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (the plot extra: "
                         "pip install -e \".[plot]\")") from None
    return plt


def _labels(ax, xlabel: str, ylabel: str, title: str) -> None:
    """A panel's grid, legend, axis labels and title."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def _save(plt, fig, path: Path, *, title: str = "", dpi: int = 100) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_estimates(estimates: list[Estimate], path: str | Path, *, title: str = "") -> Path:
    if not estimates:
        raise ValueError("nothing to plot: no layout fits; drop --plot or change the job")
    plt = _pyplot()
    path = Path(path)
    labels = [f"#{i + 1} {e.layout.short()}" for i, e in enumerate(estimates)]
    n = len(estimates)
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(15, 2.2 + 0.55 * n), sharey=True)
    cmap = plt.get_cmap("tab10")
    ys = list(range(n))[::-1]
    for ax, parts, key, unit in ((ax_m, MEMORY_PARTS, "memory_gib", "GiB per GPU"),
                                 (ax_t, TIME_PARTS, "time_s", "seconds per step")):
        left = [0.0] * n
        for j, part in enumerate(parts):
            vals = [getattr(e, key).get(part, 0.0) for e in estimates]
            if not any(v > 0 for v in vals):
                continue
            ax.barh(ys, vals, left=left, color=cmap(j % 10), label=part, height=0.7)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel(unit)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / (1 + n)), fontsize=7, ncol=5,
                  frameon=False)
        ax.grid(axis="x", alpha=0.3)
    hbm = estimates[0].hbm_gib
    ax_m.axvline(hbm, color="black", linestyle="--", linewidth=1)
    ax_m.text(hbm, n - 0.4, f" HBM {hbm:.0f} GiB", fontsize=8, va="bottom")
    for y, e in zip(ys, estimates):
        ax_t.text(e.time_s["step"], y, f" MFU {e.mfu:.0%}", va="center", fontsize=8)
    ax_m.set_yticks(ys)
    ax_m.set_yticklabels(labels, fontsize=8)
    ax_m.set_title("memory per GPU by component")
    ax_t.set_title("step time by component")
    return _save(plt, fig, path, title=title, dpi=110)


def plot_scaling(curves: dict, path: str | Path, *, title: str = "", marks: dict | None = None) -> Path:
    """tokens/s against GPUs (log-log) for each curve {"strong": [ScalePoint], "weak": [...]}, with the
    linear extrapolation of each curve's first fitting point, and `marks` {name: ScalePoint} (the
    diminishing-returns points) circled."""
    plt = _pyplot()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in curves.items():
        fit = [p for p in points if p.fits]
        if not fit:
            continue
        line, = ax.plot([p.gpus for p in fit], [p.tokens_per_s for p in fit], marker="o", label=f"{name} scaling")
        base = fit[0]
        ax.plot([p.gpus for p in fit], [base.tokens_per_s * p.gpus / base.gpus for p in fit], linestyle=":",
                color=line.get_color(), label=f"{name}: linear")
        mark = (marks or {}).get(name)
        if mark is not None:
            ax.scatter([mark.gpus], [mark.tokens_per_s], s=200, facecolors="none", edgecolors="red", zorder=5)
            ax.annotate(f"diminishing returns past {mark.gpus}", (mark.gpus, mark.tokens_per_s),
                        textcoords="offset points", xytext=(10, -15), color="red")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s (whole cluster)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_context(variants: dict, path: str | Path, *, title: str = "") -> Path:
    """`variants` {label: (answer, memory points)} from serving_context (`context_answer`, `memory_curve`): left,
    weights + KV per GPU of each variant's smallest deployment against context length, with its usable memory;
    right, the best TPOT against GPUs, the KV's scale-up domains marked."""
    plt = _pyplot()
    path = Path(path)
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    for label, (answer, memory) in variants.items():
        if not answer.get("fits"):
            continue
        xs = [m["context"] for m in memory]
        line, = ax_m.plot(xs, [m["weights_gib"] + m["kv_gib"] for m in memory], marker=".",
                          label=f"{label}: {answer['gpus']} GPUs ({answer['layout']}), weights + KV")
        ax_m.plot(xs, [m["weights_gib"] for m in memory], linestyle=":", color=line.get_color(),
                  label=f"{label}: weights")
        ax_m.axhline(memory[0]["usable_gib"], linestyle="--", linewidth=1, color=line.get_color())
        curve = answer["curve"]
        ax_t.plot([p["gpus"] for p in curve], [p["tpot_ms"] for p in curve], marker="o", color=line.get_color(),
                  label=label)
        for p in curve:
            ax_t.annotate(f"{p['nodes']}", (p["gpus"], p["tpot_ms"]), textcoords="offset points", xytext=(3, 4),
                          fontsize=7, color=line.get_color())
    ax_m.axvline(next(iter(variants.values()))[0]["context_tokens"], color="black", linewidth=0.8)
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
    _labels(ax_m, "context tokens (one sequence)", "GiB per GPU (dashed: usable)",
            "weights + KV per GPU, smallest deployment")
    _labels(ax_t, "GPUs (labels: scale-up domains the KV spans)", "TPOT ms", "per-token latency against GPUs")
    return _save(plt, fig, path, title=title)


def plot_frontier(curves: dict, path: str | Path, *, title: str = "", marks: dict | None = None) -> Path:
    """`curves` {layout label: serving_modes.frontier points}: left, output tokens/s per GPU against each request's
    tokens/s (1 / TPOT), the points labelled with the requests in flight; right, the TTFT against the same
    throughput (C closed-loop clients' first-token latency, their prompts queueing for the token budget). `marks`
    {label: (tokens/s per user, tokens/s per GPU)}: the answer of `plan infer`, a star on the left."""
    plt = _pyplot()
    path = Path(path)
    fig, (ax_f, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    for label, points in curves.items():
        if not points:
            continue
        per_gpu = [p["output_tokens_per_s_per_gpu"] for p in points]
        line, = ax_f.plot([p["tokens_per_s_per_user"] for p in points], per_gpu, marker="o", label=label)
        for p in points:
            ax_f.annotate(f"{p['concurrency']}", (p["tokens_per_s_per_user"], p["output_tokens_per_s_per_gpu"]),
                          textcoords="offset points", xytext=(3, 4), fontsize=7, color=line.get_color())
        ax_t.plot(per_gpu, [p["ttft_ms"] for p in points], marker="o", color=line.get_color(), label=label)
        if marks and label in marks:
            ax_f.plot(*marks[label], marker="*", markersize=14, color=line.get_color())
    _labels(ax_f, "tokens/s per request (1 / TPOT)", "output tokens/s per GPU",
            "throughput against interactivity (labels: requests in flight)")
    _labels(ax_t, "output tokens/s per GPU", "TTFT ms", "first-token latency against throughput (closed-loop clients)")
    ax_t.set_yscale("log")
    return _save(plt, fig, path, title=title)


def plot_published_errors(panels: dict, path: str | Path, *, title: str = "") -> Path:
    """`panels` {metric: {group: [predicted / measured - 1 of each row]}}: one panel per metric, one line per group
    (its rows as dots, its median as a bar, labelled with its row count and median |error|), the ideal at 0 and
    bands at +-10% and +-25%; errors beyond +-100% drawn at the edge."""
    panels = {metric: {g: errs for g, errs in groups.items() if errs} for metric, groups in panels.items()}
    panels = {metric: groups for metric, groups in panels.items() if groups}
    if not panels:
        raise ValueError("nothing to plot: no row was scored")
    plt = _pyplot()
    path = Path(path)
    height = 1.5 + 0.32 * max(len(groups) for groups in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), height), squeeze=False)

    def edge(e: float) -> float:
        return min(1.0, max(-1.0, e))

    for ax, (metric, groups) in zip(axes[0], panels.items()):
        # A, B, ..., Z, AA, AB, ... from the top: the groups' letters as the data README lists them
        names = sorted(groups, key=lambda g: (len(re.split(r"[_-]", g)[0]), g))[::-1]
        for y, name in enumerate(names):
            errs = groups[name]
            ax.scatter([edge(e) for e in errs], [y] * len(errs), s=12, alpha=0.6)
            ax.plot([edge(statistics.median(errs))] * 2, [y - 0.3, y + 0.3], color="black", linewidth=2)
        labels = [f"{g} ({len(groups[g])}, {100 * statistics.median(abs(e) for e in groups[g]):.0f}%)" for g in names]
        for x, style in ((0.0, "-"), (-0.1, ":"), (0.1, ":"), (-0.25, "--"), (0.25, "--")):
            ax.axvline(x, color="grey", linestyle=style, linewidth=0.8)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlim(-1.05, 1.05)
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlabel("predicted / measured - 1 (bar: the median)")
        ax.set_title(f"{metric}: group (rows, median |error|)")
    return _save(plt, fig, path, title=title)
