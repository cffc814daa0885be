"""Planner tests for the cluster-scale questions: failures (MTBF, Young/Daly interval, goodput), power and
energy, strong/weak scaling with the diminishing-returns point (`plan scale`), and scale-up vs scale-out
(`plan compare`)."""

from __future__ import annotations

import json
import math

import pytest

from meshlm.planner.cluster import get_cluster
from test_planner import _cli


def test_failures_follow_young_daly():
    from meshlm.planner.operations import FAILURE_RATE_PER_GPU_HOUR, failures

    f = failures(gpus=16384, step_s=10.0, ckpt_bytes=405e9 * 14)
    assert f["mtbf_hours"] == pytest.approx(1 / (16384 * FAILURE_RATE_PER_GPU_HOUR))
    assert 2.5 < f["mtbf_hours"] < 3.5  # Llama 3: 419 interruptions in 54 days on 16K GPUs
    d, m = f["checkpoint_write_s"], f["mtbf_hours"] * 3600
    assert f["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * d * m) - d)

    def waste(tau):
        return d / tau + ((tau + d) / 2 + f["restart_s"]) / m

    assert f["goodput"] == pytest.approx(1 - waste(f["checkpoint_interval_s"]))
    assert waste(0.7 * f["checkpoint_interval_s"]) > waste(f["checkpoint_interval_s"]) < waste(1.4 * f["checkpoint_interval_s"])
    small = failures(gpus=64, step_s=10.0, ckpt_bytes=405e9 * 14)
    assert small["goodput"] > f["goodput"] and small["mtbf_hours"] == pytest.approx(256 * f["mtbf_hours"])
    with pytest.raises(ValueError, match="storage bandwidth"):
        failures(gpus=8, step_s=1.0, ckpt_bytes=1e9, storage_bw=0)


def test_power_adds_gpu_server_network_and_pue():
    from meshlm.planner.operations import power

    h100 = get_cluster("h100")
    p = power(h100, gpus=1000, step_s=2.0, tokens_per_s=1e6, train_tokens=15e12)
    per_gpu = (700 + 575 + 110) * 1.2
    assert p["cluster_mw"] == pytest.approx(1000 * per_gpu / 1e6)
    assert p["energy_per_step_kwh"] == pytest.approx(1000 * per_gpu * 2.0 / 3.6e6)
    assert p["kwh_per_million_tokens"] == pytest.approx(1000 * per_gpu / 3.6e6)  # 1 s per million tokens
    assert p["run_mwh"] == pytest.approx(15e12 / 1e6 * p["kwh_per_million_tokens"] / 1000)
    assert p["run_days"] == pytest.approx(15e12 / 1e6 / 86400)


def test_cli_estimate_json_has_failures_and_power(capsys):
    rc, out = _cli(["plan", "estimate", "--model", "llama3-70b", "--cluster", "h100", "--gpus", "64",
                    "--layout", "tp=8,pp=4,zero_stage=1", "--global-batch-tokens", "4M", "--train-tokens", "15T",
                    "--json"], capsys)
    d = json.loads(out)
    for key in ("mtbf_hours", "checkpoint_write_s", "checkpoint_interval_s", "goodput", "checkpoint_gb"):
        assert key in d["failures"]
    for key in ("cluster_mw", "energy_per_step_kwh", "kwh_per_million_tokens", "run_days", "run_mwh"):
        assert key in d["power"]
    assert d["power"]["train_tokens"] == 15e12 and 0 < d["failures"]["goodput"] < 1
    rc, out = _cli(["plan", "estimate", "--model", "llama3-70b", "--cluster", "h100", "--gpus", "64",
                    "--layout", "tp=8,pp=4,zero_stage=1", "--global-batch-tokens", "4M"], capsys)
    assert "Failures: cluster MTBF" in out and "Young/Daly" in out and "MW" in out


def test_diminishing_returns_point():
    from meshlm.planner.scale import ScalePoint, _relate, diminishing_point, parse_gpu_counts

    assert parse_gpu_counts("8:64") == [8, 16, 32, 64] and parse_gpu_counts("8:48") == [8, 16, 32, 48]
    assert parse_gpu_counts("64,8") == [8, 64]
    with pytest.raises(ValueError, match="LO:HI"):
        parse_gpu_counts("64:8")
    tps = {8: 100.0, 16: 200.0, 32: 380.0, 64: 520.0, 128: 500.0}  # 64 -> 128 slows the system
    points = [ScalePoint(gpus=n, global_batch_tokens=1, fits=True, tokens_per_s=t) for n, t in tps.items()]
    _relate(points)
    assert points[2].marginal_share == pytest.approx(0.9) and points[3].marginal_share == pytest.approx(140 / 380)
    assert diminishing_point(points).gpus == 32
    assert points[4].marginal_share < 0


def test_cli_scale_and_plot(capsys, tmp_path):
    png = tmp_path / "scale.png"
    rc, out = _cli(["plan", "scale", "--model", "tiny", "--cluster", "h100", "--gpus", "1:4", "--seq-len", "256",
                    "--global-batch-size", "16", "--plot", str(png)], capsys)
    assert rc == 0 and "strong scaling" in out and "weak scaling" in out
    assert ("Diminishing returns past" in out) or ("No diminishing-returns point" in out)
    assert png.exists() and png.stat().st_size > 10_000
    rc, out = _cli(["plan", "scale", "--model", "tiny", "--cluster", "h100", "--gpus", "1:4", "--seq-len", "256",
                    "--global-batch-size", "16", "--mode", "strong", "--json"], capsys)
    d = json.loads(out)
    pts = d["curves"]["strong"]
    assert [p["gpus"] for p in pts] == [1, 2, 4] and all(p["global_batch_tokens"] == 16 * 256 for p in pts)
    assert pts[0]["scaling_efficiency"] == 1.0 and all(0 <= p["comm_share"] < 1 for p in pts)
    assert all(0 < p["goodput"] <= 1 and p["cluster_mw"] > 0 for p in pts)
    assert pts[0]["mtbf_hours"] == pytest.approx(4 * pts[-1]["mtbf_hours"])  # 1 GPU vs 4
    # a tiny model is latency-bound well before 4 GPUs share 16 sequences
    assert pts[-1]["tokens_per_s"] < 4 * pts[0]["tokens_per_s"]


def test_cli_compare_names_the_bounding_link(capsys):
    rc, out = _cli(["plan", "compare", "--model", "llama3-8b", "--gpus", "16", "--seq-len", "4096",
                    "--global-batch-tokens", "1M", "--cluster", "h100", "--cluster", "gb200-nvl72", "--json"], capsys)
    d = json.loads(out)
    assert [r["cluster"] for r in d["clusters"]] == ["h100", "gb200-nvl72"]
    for r in d["clusters"]:
        assert r["fits"] and r["bound"].startswith("links:") and r["cluster_mw"] > 0
    # 16 GPUs are two NVLink domains of an H100 cluster but one NVL72 domain: nothing leaves it
    assert "scale-out" not in json.dumps(d["clusters"][1]["links"])
    with pytest.raises(ValueError, match="two or more --cluster"):
        _cli(["plan", "compare", "--model", "llama3-8b", "--gpus", "16", "--global-batch-tokens", "1M",
              "--cluster", "h100"], capsys)


# ---- wording: each line agrees with the others and says why (issue 16) --------------------------------
