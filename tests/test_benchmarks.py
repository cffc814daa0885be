"""Every benchmark's smoke mode (`--smoke`), run as a subprocess: it must exit 0 and print one JSON document, so
a benchmark that breaks fails here instead of rotting unseen.

A smoke run uses the benchmark's own code paths at the smallest sizes for a step or two; where this host lacks
what it needs (a GPU, root for network namespaces, an optional extra, the published data) it prints a JSON
saying what it skipped. Nothing here looks at times. The smoke runs go two at a time (most of each is
starting Python and its ranks), each test waiting for its own.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def test_every_benchmark_is_listed():
    assert len(BENCHMARKS) >= 13 and "tp.py" in BENCHMARKS


def _smoke(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # one thread a process


@pytest.fixture(scope="module")
def smoke_runs(request):
    """The smoke runs of the benchmarks this session selected (all of them, or those `-k` picks), started at once."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and "script" in getattr(getattr(item, "callspec", None), "params", {})]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the longest first, so that no long run ends alone
        yield {script: pool.submit(_smoke, script) for script in sorted(selected, key=_slow_first)}


# The smoke runs that take longest on two cores (10-25 s each alone; most others take under 8 s). They run in the
# slow tier (pytest -m slow): each is a drill of a path the default run's own tests cover (the serving engine against
# transformers, RAG, a SIGKILLed rank's restart, the planner against this machine, the emulated two-tier cluster),
# and together they were ~40 s of the default run's wall time.
SLOWEST = ("serve.py", "rag.py", "faults.py", "planner_vs_measured.py", "cp_emulated.py")


def _slow_first(script: str) -> int:
    return SLOWEST.index(script) if script in SLOWEST else len(SLOWEST)


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOWEST else s
                                    for s in BENCHMARKS])
def test_benchmark_smoke_mode_prints_json(smoke_runs, script):
    done = smoke_runs[script].result()
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert isinstance(out, dict) and out, done.stdout[-2000:]
    assert out.get("smoke") is True or "skipped" in out, sorted(out)


def test_prefix_cache_smoke_prices_each_run_with_a_calibration(tmp_path):
    """The planner part of prefix_cache.py, which its smoke run skips without a calibration file: given one (written
    here, its figures made up -- only the part's shape is checked), every measured run gets its predictions."""
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({
        "matmul_flops": 5e10, "attention_flops": 2e10, "memory_bandwidth": 2e10, "cpu_cores": 2,
        "link": {"bandwidth": 1e9, "latency": 1e-4},
        "serving_host": {"step_s": 1e-3, "layer_s": 2e-4, "seq_s": 3e-5, "layer_seq_s": 4e-6}}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prefix_cache.py"), "--smoke", "--calibration",
                           str(calibration)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    runs, priced = out["runs"], out["planner"]["runs"]
    assert [r["hit_measured"] for r in runs] == [0.0, 0.5]  # whole blocks of the 64-token prompts: as asked
    assert [p["hit"] for p in priced] == [0.0, 0.5]
    for p in priced:
        assert {"ttft_ms", "tpot_ms"} <= set(p["single"]) and "output_tokens_per_s" in p["batch"]
    # half the prompt cached: the priced TTFT falls (its host time per step stays)
    assert priced[1]["single_ttft_over_cold"]["predicted"] < 1.0


def test_speculative_planner_smoke_prices_both_runs_with_a_calibration(tmp_path):
    """The planner part of speculative_planner.py (skipped by its smoke run without a calibration file): given one
    (made-up figures, as above), the plain and the draft runs each get their predictions, at the chain acceptance
    the draft run measured, and the draft's effect on the TPOT is set beside the measured one."""
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({
        "matmul_flops": 5e10, "attention_flops": 2e10, "memory_bandwidth": 2e10, "cpu_cores": 2,
        "link": {"bandwidth": 1e9, "latency": 1e-4},
        "serving_host": {"step_s": 1e-3, "layer_s": 2e-4, "seq_s": 3e-5, "layer_seq_s": 4e-6}}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speculative_planner.py"), "--smoke",
                           "--calibration", str(calibration)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    stats, priced = out["runs"]["draft"]["spec_stats"], out["planner"]
    assert stats["proposed"] > 0 and out["runs"]["plain"]["spec_stats"]["proposed"] == 0
    assert priced["chain_p"] == out["runs"]["draft"]["acceptance"]["chain_p"]
    for run in ("plain", "draft"):
        assert {"ttft_ms", "tpot_ms"} <= set(priced[run]["single"]) and "output_tokens_per_s" in priced[run]["batch"]
    assert set(priced["draft_over_plain_tpot"]) == {"single", "batch"}
