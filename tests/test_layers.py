"""The source tree's imports point one way: each layer imports only from the layers below it.

    core        rules values dims presets config hf_config config_doc files nccl_order comm_stats mesh comm distributed
                liveness stragglers host_memory processes emulate messages tokenizer schedules timeline plot
    models      the plain single-device models (and their arithmetic, models.stats)
    parallel    the transforms that apply each strategy to a model on a mesh
    checkpoint  the checkpoint format, which training and serving both read
    data        corpora read in memory or prepared into token shards, and the loaders over them
    train | infer   side by side: neither imports the other
    tools       verify evaluate convert launch replica_launch
    planner     torch-free apart from `planner.calibrate`, which measures this machine
    cli         every command-line entry point (and `python -m meshlm`)

Imports inside functions count too (a lazy import is still a dependency). The package root
(`meshlm/__init__.py`, a lazy re-export of `LLM` and `SamplingParams`) stands above everything.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlm"

LAYERS = [
    ("core", {"rules", "values", "dims", "presets", "config", "hf_config", "config_doc", "files", "nccl_order",
              "comm_stats", "mesh", "comm", "distributed", "liveness", "stragglers", "host_memory", "processes",
              "emulate", "messages", "tokenizer", "schedules", "timeline", "plot"}),
    ("models", {"models"}),
    ("parallel", {"parallel"}),
    ("checkpoint", {"checkpoint"}),
    ("data", {"data"}),
    ("train | infer", {"train", "infer"}),
    ("tools", {"verify", "evaluate", "convert", "launch", "replica_launch"}),
    ("planner", {"planner"}),
    ("cli", {"cli", "__main__"}),  # __main__: `python -m meshlm`, the same command
]
SIDE_BY_SIDE = {"train", "infer"}  # the one layer whose units must not import each other


def unit_of(module: str) -> str | None:
    """'meshlm.parallel.zero' -> 'parallel'; 'meshlm' itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "meshlm" else None


def layer_of(unit: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"meshlm.{unit} is in no layer of tests/test_layers.py; add it where it belongs")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every meshlm module `path` imports, at the top or inside a function."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if (SRC.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                        (SRC.parent / sub.replace(".", "/")).is_dir():
                    found.add(sub)  # `from meshlm import comm` imports the module meshlm.comm
                elif not (target == "meshlm" and alias.name.startswith("__")):  # meshlm.__version__
                    found.add(target)
    return {m for m in found if m == "meshlm" or m.startswith("meshlm.")}


def arrows() -> list[tuple[str, str]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        src = module_name(path)
        for dst in imports_of(path):
            out.append((src, dst))
    return out


def test_every_import_points_down():
    wrong = []
    for src, dst in arrows():
        su, du = unit_of(src), unit_of(dst)
        if su is None:  # the package root
            continue
        if du is None:
            wrong.append(f"{src} -> meshlm (import the module that defines the name)")
            continue
        if su == du:
            continue
        ls, ld = layer_of(su), layer_of(du)
        if ld > ls:
            wrong.append(f"{src} -> {dst} ({LAYERS[ls][0]} imports {LAYERS[ld][0]}, a layer above it)")
        elif ld == ls and su in SIDE_BY_SIDE:
            wrong.append(f"{src} -> {dst} ({su} and {du} stand side by side)")
    assert not wrong, "imports against the layers:\n  " + "\n  ".join(sorted(wrong))


def test_the_layering_test_can_fail():
    """The checker itself: an upward and a sideways arrow are both caught."""
    assert layer_of("parallel") < layer_of("train") and layer_of("train") == layer_of("infer")
    assert unit_of("meshlm.parallel.zero") == "parallel" and unit_of("meshlm") is None
    with pytest.raises(AssertionError, match="no layer"):
        layer_of("nowhere")


@pytest.mark.parametrize("module", ["meshlm.planner", "meshlm.planner.search", "meshlm.planner.cost",
                                    "meshlm.planner.serving_modes", "meshlm.planner.published_serving",
                                    "meshlm.planner.scale", "meshlm.planner.explain",
                                    "meshlm.planner.published",
                                    "meshlm.schedules", "meshlm.timeline", "meshlm.tokenizer", "meshlm.cli"])
def test_torch_free(module):
    """The planner, the schedules and the command line's parser import no torch (a laptop without it can plan)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", f"importing {module} imported torch"
