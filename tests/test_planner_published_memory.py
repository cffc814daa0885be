"""The planner's memory against the memory published training runs printed (`planner/published.py`'s
`_memory_compared`, `published_rows.memory_of`): each figure read in the measure and unit its row names (PyTorch's
peak allocated or reserved memory, or nvidia-smi's used memory; GiB or GB) and compared with the same part of the
planner's memory model. Arithmetic only: no ranks are started."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_planner_stacks import _row  # a published-run row with every column

DEV = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "published_runs_dev.csv"


@pytest.mark.parametrize("notes, measure, gib", [
    ("Memory Used = torch.cuda.max_memory_allocated() / 1e9", "allocated", 40e9 / 2**30),
    ("the report's Mem/GPU is the peak allocated", "allocated", 40.0),
    ("torchtitan's log line (its peak reserved, torch.cuda max_memory_reserved)", "reserved", 40.0),
    ("mem as printed, GiB used of 80 (FlagPerf's monitor logs nvidia-smi's used MiB)", "device", 40.0),
    ("*Mem = max memory used by the first nodes", None, None),  # no tool named: not compared
])
def test_a_memory_cell_is_read_in_the_measure_and_unit_its_row_names(notes, measure, gib):
    from meshlm.planner.published_rows import memory_of

    got = memory_of(_row(notes=notes, mem_gb_per_gpu="40"))
    assert got == (None if measure is None else (measure, pytest.approx(gib)))
    assert memory_of(_row(notes=notes, mem_gb_per_gpu="")) is None


def test_each_measure_is_compared_with_its_own_part_of_the_memory_model():
    """One row priced three times, its figure named as each measure: "allocated" is the live tensors, "reserved"
    those plus the allocator's fragmentation margin (`memory.FRAGMENTATION` of them), "device" all of that plus the
    cluster's reserved bytes (CUDA context, NCCL) -- exactly, so a measure compared with the wrong part fails."""
    from meshlm.planner.cluster import GiB, get_cluster
    from meshlm.planner.memory import FRAGMENTATION
    from meshlm.planner.published import predict_row

    row = _row(model="Llama 2 7B", layers="32", hidden="4096", heads="32", kv_heads="32", ffn="11008", vocab="32000",
               n_gpus="8", dp="8", zero_fsdp="FSDP (ZeRO-3)", seq_len="4096", gbs_seqs="8", mem_gb_per_gpu="30",
               tokens_per_s_per_gpu="3000")
    got = {m: predict_row({**row, "notes": note})["memory"] for m, note in (
        ("allocated", "torch.cuda.max_memory_allocated"), ("reserved", "max_memory_reserved"),
        ("device", "nvidia-smi"))}
    assert {m: g["measure"] for m, g in got.items()} == {m: m for m in got}
    allocated, reserved, device = (got[m]["predicted_gib"] for m in ("allocated", "reserved", "device"))
    assert reserved == pytest.approx(allocated * (1 + FRAGMENTATION), abs=0.01)
    assert device - reserved == pytest.approx(get_cluster("a100").reserved_bytes / GiB, abs=0.01)
    assert got["device"]["error"] == pytest.approx(device / 30 - 1, abs=1e-3)
    assert "memory" not in predict_row(row)  # no measure named: nothing compared


def test_every_memory_figure_of_the_dev_rows_is_compared_or_unread_for_want_of_a_measure():
    """Every development row printing memory is compared, except BigScience's prequel (its "Mem" names no tool), and
    the memory model's median |error| over them stays <= 12%, every group's <= 30% (torchtitan's per-op selective
    checkpointing, priced as half of full recomputation, leaves group AN's 25% over its logged peak) but AWS's eager
    torchtitan run (AU), whose script leaves PyTorch's allocator without expandable segments: its logged peak
    reserved 68.6 GiB where the live tensors priced are 44 GiB (-36%), bounded apart at 40%, the allocator's
    fragmentation without them not priced."""
    from meshlm.planner.published import read_runs, score_runs

    rows = read_runs(DEV)
    results, summary = score_runs(rows)
    compared = {r["row_id"] for r in results if "memory" in r}
    printed = {r["row_id"]: r["group"] for r in rows if r["mem_gb_per_gpu"].strip()}
    assert {g for i, g in printed.items() if i not in compared} == {"S_bloom_prequel_a100_pipeline"}
    memory = summary["memory"]
    assert memory["rows"] == len(compared) >= 41
    assert memory["median_abs_error"] <= 0.12, memory
    apart = {"AU_aws_torchtitan_p5_h100_fsdp": 0.40}
    assert all(g["median_abs_error"] <= apart.get(k, 0.30) for k, g in memory["per_group"].items()), memory
    assert {g["measure"] for g in memory["per_group"].values()} == {"allocated", "reserved", "device"}


def test_fp8_weights_held_beside_the_bf16_ones_or_in_their_place_and_gathered_in_one_byte(capsys):
    """Transformer Engine's cached fp8 weights (`Job.fp8_weights` "cached") keep a row-wise and a column-wise fp8 copy
    of every layer GEMM weight beside the bf16 weights: exactly 2 bytes per such weight more than bf16 training holds;
    Megatron's fp8 parameters ("params", NVIDIA's recipes) are those copies in place of the bf16 weights (memory as
    bf16's), and the distributed optimizer gathers them in one byte: the parameters' all-gather shrinks by exactly a
    byte per layer GEMM weight. A FlagPerf fp8 row (Megatron-Core without --fp8-param-gather) reads as cached, an
    NVIDIA recipe's as parameters; `meshlm plan --fp8-weights` chooses, with --precision fp8 only."""
    import json

    from test_planner import _cli

    from dataclasses import replace

    from meshlm.config import ModelConfig
    from meshlm.planner.cluster import GiB, get_cluster
    from meshlm.planner.collectives import collective_time, group_span
    from meshlm.planner.cost import Job, Layout, ModelSummary, estimate_layout
    from meshlm.planner.published import job_of, read_runs
    from meshlm.planner.published_rows import model_of

    cfg, cluster = ModelConfig.from_preset("llama3-8b"), get_cluster("h100")
    summary = ModelSummary.build(cfg, 4096)
    job = Job(seq_len=4096, global_batch_size=32, dp_comm_overlap=False)
    lo = Layout(dp_shard=8, tp=2, sequence_parallel=True, zero_stage=1, micro_batch_size=1)
    est = {w: estimate_layout(summary, cluster, replace(job, precision="fp8", fp8_weights=w), lo, num_microbatches=4)
           for w in ("cached", "params")}
    bf16 = estimate_layout(summary, cluster, job, lo, num_microbatches=4)
    gemm = cfg.num_layers * summary.layer_tp / 2  # the rank's layer GEMM weights (tp 2)
    assert (est["cached"].memory_gib["weights"] - bf16.memory_gib["weights"]) * GiB == pytest.approx(2 * gemm)
    assert est["params"].memory_gib["weights"] == pytest.approx(bf16.memory_gib["weights"])
    span = group_span(2, 8, cluster.scaleup_size)
    gathered = bf16.memory_gib["weights"] * GiB
    saved = (collective_time("all_gather", gathered, span, cluster)
             - collective_time("all_gather", gathered - gemm, span, cluster))
    assert saved > 0
    assert est["cached"].time_s["dp_comm"] - est["params"].time_s["dp_comm"] == pytest.approx(saved, rel=1e-6)
    rows = {r["row_id"]: r for r in read_runs(DEV)}
    for row_id, weights in (("R581", "cached"), ("R066", "params")):
        assert job_of(rows[row_id], model_of(rows[row_id])).fp8_weights == weights
    argv = ["plan", "estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "16", "--seq-len", "4096",
            "--global-batch-size", "32", "--layout", "dp_shard=8,tp=2,zero_stage=1", "--precision", "fp8", "--json"]
    weights = {w: json.loads(_cli(argv + ["--fp8-weights", w], capsys)[1])["memory_gib"]["weights"]
               for w in ("cached", "params")}
    assert json.loads(_cli(argv, capsys)[1])["memory_gib"]["weights"] == weights["cached"]  # the default
    assert (weights["cached"] - weights["params"]) * GiB == pytest.approx(2 * gemm, rel=1e-3)
    with pytest.raises(ValueError, match="give --precision fp8 or leave --fp8-weights out"):
        _cli(argv[:-3] + ["--json", "--fp8-weights", "params"], capsys)


def test_plan_estimate_gives_the_memory_as_the_tools_report_it(capsys):
    """`meshlm plan estimate` states the layout's memory in the three measures published runs are scored in (JSON
    `memory_measured_as_gib`; the text's "As measured" sentence): the live tensors, those with the fragmentation
    margin, and all of it with the cluster's reserved bytes -- the device figure is the total that decides the fit."""
    import json

    from test_planner import _cli

    from meshlm.planner.cluster import GiB, get_cluster
    from meshlm.planner.memory import FRAGMENTATION

    argv = ["plan", "estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", "--seq-len", "4096",
            "--global-batch-size", "16", "--layout", "dp_shard=8,zero_stage=3,recompute=full"]
    out = json.loads(_cli(argv + ["--json"], capsys)[1])
    m = out["memory_measured_as_gib"]
    assert m["device"] == pytest.approx(out["memory_gib"]["total"])
    assert m["reserved"] == pytest.approx(m["allocated"] * (1 + FRAGMENTATION))
    assert m["device"] - m["reserved"] == pytest.approx(get_cluster("h100").reserved_bytes / GiB)
    text = _cli(argv, capsys)[1]
    assert f"max_memory_allocated ~{m['allocated']:.1f} GiB" in text and f"nvidia-smi ~{m['device']:.1f} GiB" in text
