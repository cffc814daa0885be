"""`meshlm plan context` (planner/serving_context.py): the smallest deployment that holds one long context, its
TPOT and where more GPUs stop paying -- checks that can fail, torch-free."""

import argparse
import json
from dataclasses import replace

import pytest

from meshlm.cli.plan import add_parser as add_plan_parser
from meshlm.cli.plan import run as run_plan
from meshlm.planner.cluster import get_cluster
from meshlm.planner.serving import Serving
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_context import (STOP_GAIN, best_layout, context_answer, smallest_deployment,
                                            stops_paying)
from meshlm.planner.serving_model import served_model

MILLION = 2**20


def _cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="meshlm")
    add_plan_parser(parser.add_subparsers(dest="command"))
    rc = run_plan(parser.parse_args(argv))
    return rc, capsys.readouterr().out


def _sv(model="llama3-405b", cluster="h100", kv="bf16"):
    return Serving(served_model(model), get_cluster(cluster), ServingLayout(), kv_precision=kv)


@pytest.mark.parametrize("cluster", ["gb200-nvl72", "h100"])
def test_405b_million_token_context_prints_a_deployment(cluster, capsys):
    rc, out = _cli(["plan", "context", "--model", "llama3-405b", "--cluster", cluster, "--context", "1M", "--json"],
                   capsys)
    d = json.loads(out)
    assert rc == 0 and d["fits"] and d["context_tokens"] == MILLION
    for key in ("gpus", "layout", "nodes", "tpot_ms", "ttft_s", "bound", "curve", "stops_paying"):
        assert key in d, key
    assert d["tpot_ms"] > 0 and d["nodes"] >= 1 and d["bound"] in ("compute", "memory bandwidth", "scale-up link",
                                                                  "scale-out link", "host")
    # what the GPUs hold: weights + the sequence's KV within each GPU's memory
    assert d["weights_gib_per_gpu"] + d["kv_gib_per_gpu"] <= get_cluster(cluster).hbm_bytes / 2**30
    rc, text = _cli(["plan", "context", "--model", "llama3-405b", "--cluster", cluster, "--context", "1M"], capsys)
    assert "smallest deployment" in text and "TPOT" in text and "node" in text and "bound" in text


def test_the_smallest_deployment_is_smallest_and_holds_the_context():
    sv, context = _sv(), 256 * 1024
    small = smallest_deployment(sv, context, 1, max_gpus=256)
    assert small is not None
    assert best_layout(sv, small["gpus"] - 1, context, 1) is None  # one GPU fewer holds no layout of it
    lo = ServingLayout(**{k: int(v) for k, v in (kv.split("=") for kv in small["layout"].split(","))})
    assert replace(sv, layout=lo).max_tokens() >= context + 1
    # fp8 KV halves the sequence's bytes: never a bigger deployment
    assert smallest_deployment(_sv(kv="fp8"), context, 1, max_gpus=256)["gpus"] <= small["gpus"]


def test_tpot_is_bounded_by_the_weights_and_more_gpus_stop_paying():
    sv = _sv("llama3-70b")
    d = context_answer(sv, MILLION, 16, max_gpus=512)
    weights = served_model("llama3-70b").params()["total"] * 2  # bf16
    for p in d["curve"]:
        tp = int(p["layout"].split(",")[0].split("=")[1])
        # one token streams every weight once, tp GPUs at a time (pp stages run one after another, cp replicates)
        assert p["tpot_ms"] / 1e3 >= weights / tp / sv.cluster.hbm_bw
    stop = d["stops_paying"]
    after = [p for p in d["curve"] if p["gpus"] == 2 * stop["gpus"]]
    assert not after or after[0]["tpot_ms"] > (1 - STOP_GAIN) * stop["tpot_ms"]
    assert stops_paying([]) is None


def test_a_context_no_deployment_holds_says_so(capsys):
    rc, out = _cli(["plan", "context", "--model", "llama3-405b", "--cluster", "h100", "--context", "64M",
                    "--max-gpus", "16", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and not d["fits"] and "--max-gpus" in d["reason"]
    with pytest.raises(ValueError, match="size"):
        _cli(["plan", "context", "--model", "llama3-8b", "--context", "lots"], capsys)


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "context.png"
    rc, text = _cli(["plan", "context", "--model", "llama3-70b", "--cluster", "gb200-nvl72", "--context", "1M",
                     "--max-gpus", "256", "--plot", str(out)], capsys)
    assert rc == 0 and out.exists() and out.stat().st_size > 10_000 and "wrote" in text


def test_a_context_beyond_the_models_window_is_priced_and_said(capsys):
    """Llama 3.1 405B's window is 131,072 tokens (max_position_embeddings): 1M is priced, with the note saying so;
    a context within the window carries none."""
    d = context_answer(_sv(), MILLION, 1, max_gpus=256)
    assert d["fits"] and d["model_context_tokens"] == 131072
    assert "131,072" in d["context_note"] and "1,048,577" in d["context_note"]
    assert context_answer(_sv(), 131071, 1, max_gpus=256)["context_note"] is None
    rc, text = _cli(["plan", "context", "--model", "llama3-405b", "--cluster", "h100", "--context", "1M"], capsys)
    assert rc == 0 and "beyond the model's context window of 131,072" in text
    rc, out = _cli(["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", "--tp", "1", "--input-len", "131000",
                    "--output-len", "72", "--concurrency", "1", "--json"], capsys)
    assert json.loads(out)["context_note"] is None  # 131,072 tokens: the window exactly
    rc, text = _cli(["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", "--tp", "1", "--input-len",
                     "131000", "--output-len", "73", "--concurrency", "1"], capsys)
    assert rc == 0 and "131,073 tokens is beyond the model's context window" in text
