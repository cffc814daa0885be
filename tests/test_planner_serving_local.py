"""The serving planner on this machine (`meshlm plan infer --cluster local`): checks that can fail, torch-free.

fp32 weights and KV on `local` (as meshlm serves on CPUs): twice the bytes of bf16, the default there; meshlm's
engine adds exactly the host seconds the calibration measured (per step, sequence, layer and (layer, sequence)),
and is refused on a file that lacks them; ranks beyond the recorded cores time-share them; a cp decode token's
projections run on its owner only; the calibration's fit of the engine's host time recovers its terms.
"""

import argparse
import json
from dataclasses import replace

import pytest

from meshlm.cli.plan import add_parser as add_plan_parser
from meshlm.cli.plan import run as run_plan
from meshlm.planner.calibrate_serving import SERVING_LAYERS, SERVING_SEQS, _fit_weight_pass, _least_squares
from meshlm.planner.cluster import get_cluster
from meshlm.planner.serving import Serving, iteration_time
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_engine import ENGINES, engine, meshlm_engine
from meshlm.planner.serving_model import served_model

HOST = {"step_s": 1e-3, "layer_s": 2e-4, "seq_s": 3e-5, "layer_seq_s": 4e-6}
CALIBRATION = {"matmul_flops": 5e10, "attention_flops": 2e10, "memory_bandwidth": 2e10, "cpu_cores": 2,
               "link": {"bandwidth": 1e9, "latency": 1e-4}}


def _local(tmp_path, name="cal", **extra):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**CALIBRATION, **extra}))
    return get_cluster("local", calibration=path), path


def _sv(cluster, *, precision="fp32", host=HOST, **layout):
    return Serving(served_model("tiny"), cluster, ServingLayout(**layout), precision=precision,
                   kv_precision=precision, engine=meshlm_engine(host))


def test_fp32_on_local_doubles_weight_and_kv_bytes_and_is_the_default(tmp_path, capsys):
    cluster, path = _local(tmp_path, serving_host=HOST)
    fp32, bf16 = _sv(cluster), _sv(cluster, precision="bf16")
    assert sum(fp32.weight_bytes_per_gpu().values()) == 2 * sum(bf16.weight_bytes_per_gpu().values())
    assert fp32.kv_bytes_per_token_per_gpu() == 2 * bf16.kv_bytes_per_token_per_gpu()

    def cli(*extra):
        parser = argparse.ArgumentParser(prog="meshlm")
        add_plan_parser(parser.add_subparsers(dest="command"))
        assert run_plan(parser.parse_args(["plan", "infer", "--model", "tiny", "--cluster", "local", "--calibration",
                                           str(path), "--tp", "1", "--batch", "4", "--input-len", "32",
                                           "--output-len", "8", "--json", *extra])) == 0
        return json.loads(capsys.readouterr().out)

    default, half = cli(), cli("--precision", "bf16", "--kv-precision", "bf16")
    assert default["precision"] == default["kv_precision"] == "fp32"
    assert default["weights_gib"] == pytest.approx(2 * half["weights_gib"])
    assert default["kv_bytes_per_token"] == 2 * half["kv_bytes_per_token"]
    # the calibrated engine is the default on `local`: its host seconds are in the iteration
    assert default["iteration_ms"]["scheduler"] > 0


def test_meshlm_engine_adds_exactly_the_calibrated_host_time(tmp_path):
    cluster, _ = _local(tmp_path, serving_host=HOST)
    assert cluster.serving_host == HOST and engine("meshlm", cluster) == meshlm_engine(HOST)
    layers, decodes, prompt = served_model("tiny").layers, 6, 40
    more = {k: 2 * v for k, v in HOST.items()}
    for kw, seqs in ((dict(decodes=decodes, kv_len=100), decodes),
                     # a static batch's prefill: 3 prompts of `prompt` tokens (mean context half the prompt)
                     (dict(decodes=0, kv_len=0, prefill_tokens=3 * prompt, prefill_ctx=prompt / 2), 3)):
        base, doubled = (iteration_time(_sv(cluster, host=h), **kw) for h in (HOST, more))
        expected = HOST["step_s"] + HOST["seq_s"] * seqs + layers * (HOST["layer_s"] + HOST["layer_seq_s"] * seqs)
        assert base["scheduler"] == pytest.approx(expected, rel=1e-12)
        assert doubled["total"] - base["total"] == pytest.approx(expected, rel=1e-9)  # nothing else moved


def test_meshlm_engine_needs_a_calibration_that_measured_it(tmp_path):
    old, _ = _local(tmp_path)  # a file from before the engine's host timing: still read
    assert old.serving_host == {} and old.peak("fp32") == CALIBRATION["matmul_flops"]
    with pytest.raises(ValueError, match="plan calibrate"):
        engine("meshlm", old)
    with pytest.raises(ValueError, match="plan calibrate"):
        engine("meshlm", get_cluster("h100"))
    with pytest.raises(ValueError, match="meshlm"):
        engine("nonsense")
    assert "meshlm" not in ENGINES  # priced from a cluster's measurement, not a preset


def test_local_serving_ranks_beyond_the_cores_time_share_them(tmp_path):
    two, _ = _local(tmp_path, "two", serving_host=HOST)
    one = replace(two, compute_slots=1)
    kw = dict(decodes=4, kv_len=64)
    shared, alone = iteration_time(_sv(one, tp=2), **kw), iteration_time(_sv(two, tp=2), **kw)
    for key in ("gemm_compute", "gemm_memory", "attention_compute", "attention_memory"):
        assert shared[key] == pytest.approx(2 * alone[key])
    # one rank on one core: nothing shared
    assert iteration_time(_sv(one), **kw)["gemm_memory"] == pytest.approx(iteration_time(_sv(two), **kw)["gemm_memory"])


def test_cp_decode_tokens_run_their_projections_on_their_owner_only(tmp_path):
    cluster, _ = _local(tmp_path, serving_host=HOST)
    kw = dict(decodes=8, kv_len=64)
    one, two = iteration_time(_sv(cluster), **kw), iteration_time(_sv(cluster, cp=2), **kw)
    assert two["gemm_compute"] == pytest.approx(one["gemm_compute"] / 2)
    plain = replace(_sv(cluster, cp=2), engine=ENGINES["default"])
    assert iteration_time(plain, **kw)["gemm_compute"] == pytest.approx(one["gemm_compute"])


def test_calibration_fit_of_the_engine_host_time_recovers_its_terms():
    a, b, c, d = 3e-4, 2e-4, 1e-5, 5e-6
    rows = [[1.0, lay, n, lay * n] for lay in SERVING_LAYERS for n in SERVING_SEQS]
    fit = _least_squares(rows, [a + b * lay + c * n + d * lay * n for _, lay, n, _ in rows])
    assert fit == pytest.approx([a, b, c, d], rel=1e-9)


def test_a_cpu_gemm_passes_its_weights_then_multiplies(tmp_path):
    """With the calibration's `gemm_weight_bandwidth` a GEMM takes its weights' pass at that rate, `gemm_call_s` per
    weight matrix, plus its FLOPs at the matmul rate (a CPU BLAS packs, then multiplies); without them, the
    roofline's corner (less than the sum)."""
    cluster, _ = _local(tmp_path, serving_host=HOST, gemm_weight_bandwidth=5e9, gemm_call_s=2e-5)
    plain, _ = _local(tmp_path, name="plain", serving_host=HOST)
    kw = dict(decodes=8, kv_len=64)
    cpu, gpu = iteration_time(_sv(cluster), **kw), iteration_time(_sv(plain), **kw)
    sv = _sv(cluster)
    weights, matrices = sum(sv.weight_bytes_per_gpu().values()), 7 * sv.sm.cfg.num_layers + 1  # q k v o gate up down
    assert cpu["gemm_memory"] == pytest.approx(weights / 5e9 + matrices * 2e-5, rel=1e-12)
    assert cpu["gemm_compute"] == gpu["gemm_compute"]
    assert cpu["total"] - gpu["total"] == pytest.approx(
        cpu["gemm_compute"] + cpu["gemm_memory"] - (gpu["gemm_compute"] ** 2 + gpu["gemm_memory"] ** 2) ** 0.5, rel=1e-9)


def test_one_row_streams_the_weights_unpacked_where_the_calibration_measured_it(tmp_path):
    """One decoding sequence is a matrix-vector product: its weights' pass at `gemv_weight_bandwidth` and
    `gemv_call_s` per matrix, in place of the packing pass and the FLOPs; two rows pack. A file without the GEMV
    terms prices one row as packed."""
    gemv = dict(gemv_weight_bandwidth=1.5e10, gemv_call_s=1e-5)
    cluster, _ = _local(tmp_path, serving_host=HOST, gemm_weight_bandwidth=5e9, gemm_call_s=2e-5, **gemv)
    older, _ = _local(tmp_path, name="older", serving_host=HOST, gemm_weight_bandwidth=5e9, gemm_call_s=2e-5)
    sv = _sv(cluster)
    weights, matrices = sum(sv.weight_bytes_per_gpu().values()), 7 * sv.sm.cfg.num_layers + 1
    one, two = (iteration_time(sv, decodes=n, kv_len=64) for n in (1, 2))
    assert one["gemm_memory"] == pytest.approx(weights / 1.5e10 + matrices * 1e-5, rel=1e-12)
    assert two["gemm_memory"] == pytest.approx(weights / 5e9 + matrices * 2e-5, rel=1e-12)
    old_one = iteration_time(_sv(older), decodes=1, kv_len=64)
    assert old_one["gemm_memory"] == pytest.approx(weights / 5e9 + matrices * 2e-5, rel=1e-12)
    # the one-row pass replaces the packed pass and the FLOPs' time: nothing else in the iteration moves
    assert old_one["total"] - one["total"] == pytest.approx(
        old_one["gemm_compute"] + old_one["gemm_memory"] - one["gemm_memory"], rel=1e-9)


def test_the_weight_pass_fit_recovers_bandwidth_and_call_cost():
    bandwidth, call, nbytes = 8e9, 6e-6, 32 * 2**20
    passes = [(n, nbytes, n * call + nbytes / bandwidth) for n in (128, 2)]
    assert _fit_weight_pass(passes) == pytest.approx((bandwidth, call), rel=1e-9)
    assert _fit_weight_pass([(128, nbytes, 1e-3), (2, nbytes, 1e-5)])[0] == 0.0  # no time left for the bytes
