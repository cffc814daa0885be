"""Checks only a machine with NVIDIA GPUs can make (skipped without CUDA); `tests/gpu/run.sh` runs them with the
benchmarks on CUDA. What each shows:
- one GPU: training in bf16 on CUDA follows the fp32 CPU run's losses closely; a model built sharded on the
  GPU; the pipeline timeline measured by CUDA events; greedy serving on CUDA, pinned to its device; a resume
  from an asynchronously staged checkpoint; MoE in bf16; `meshlm train --nproc 1` through the launcher (NCCL);
  speculative decoding's greedy tokens; context parallelism's attention pairs on CUDA's flash kernel; KV cache
  tiers (pinned host buffers, disk) giving the same greedy tokens; a blocking collective wait raising past its
  timeout on a stream the device has not passed; the planner's time for one device's training step of Llama 3 8B
  layers within 25% of the measured one (on a GPU the planner has a preset for);
- two GPUs and more (NCCL): pp=2 under every schedule, cp=2 ring attention, ep=2, tp=2 x ZeRO-3 (4 GPUs),
  each through `meshlm train --nproc` with a short collective timeout; `meshlm serve --tp 2` answering after
  an idle period longer than its collective timeout; a stopped rank failing a run under blocking waits. These are the orders `tests/test_nccl_order.py` proves
  deadlock-free on CPU; here NCCL itself runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

SMALL = ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=128", "model.max_seq_len=64", "train.seq_len=64", "train.global_batch_size=8",
         "train.micro_batch_size=2", "train.val_batches=1", "train.val_interval=10", "train.lr=3e-3",
         "train.warmup_steps=2", "train.progress=false", "parallel.collective_timeout_s=60"]


def _corpus(tmp_path: Path) -> Path:
    from runs import write_corpus

    return write_corpus(tmp_path / "corpus.txt", 400)


def _losses(run_dir: Path) -> list[float]:
    from runs import step_losses

    return step_losses(run_dir)


def _steps_logged(run_dir: Path) -> int:
    """Steps a running job has logged so far (0 before its log exists or while a line is half written)."""
    try:
        return len(_losses(run_dir))
    except (OSError, ValueError):
        return 0


def test_bf16_on_cuda_follows_the_fp32_cpu_run(tmp_path):
    from meshlm.config import load_config
    from meshlm.train.trainer import Trainer

    corpus = _corpus(tmp_path)
    runs = {}
    for device, precision in (("cpu", "fp32"), ("cuda", "bf16")):
        run_dir = tmp_path / device
        cfg = load_config(overrides=[*SMALL, f"data.path={corpus}", f"train.run_dir={run_dir}", "train.steps=10",
                                     f"train.device={device}", f"train.precision={precision}"])
        Trainer(cfg).train()
        runs[device] = _losses(run_dir)
    assert runs["cuda"][-1] < runs["cuda"][0] - 0.5
    assert max(abs(a - b) for a, b in zip(runs["cpu"], runs["cuda"])) < 0.1, runs


def test_a_model_built_sharded_on_the_gpu_holds_the_single_device_values(tmp_path):
    from meshlm.config import load_config
    from meshlm.models.transformer import build_model
    from meshlm.train.trainer import Trainer

    cfg = load_config(overrides=[*SMALL, f"data.path={_corpus(tmp_path)}", f"train.run_dir={tmp_path / 'r'}",
                                 "train.device=cuda"])
    trainer = Trainer(cfg)
    whole = build_model(cfg.model, seed=cfg.train.seed).state_dict()
    for name, p in trainer.base_model.state_dict().items():
        assert p.device.type == "cuda"
        torch.testing.assert_close(p.cpu(), whole[name], rtol=0, atol=0)


def test_the_pipeline_timeline_is_measured_on_the_gpu():
    from meshlm.parallel.pipeline import StepClock

    clock = StepClock(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    start = clock.mark()
    for _ in range(20):
        x = x @ x.T / 4096
    end = clock.mark()
    # the host queued the matmuls in microseconds; the events saw the GPU do them
    assert clock.seconds(end) - clock.seconds(start) > 1e-4


def test_greedy_serving_on_cuda_equals_the_cpu(tmp_path):
    from tiny_hf import make_model_dir

    from meshlm import LLM, SamplingParams

    model_dir = make_model_dir(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    cpu = LLM(str(model_dir), device="cpu", dtype=torch.float32).generate(["hello world"], greedy)[0].token_ids
    gpu = LLM(str(model_dir), device="cuda", dtype=torch.float32).generate(["hello world"], greedy)[0].token_ids
    assert gpu == cpu


def test_resume_on_cuda_with_async_pinned_staging_continues_the_run(tmp_path):
    """A checkpoint staged asynchronously (pinned host buffers, off the training thread), this device's RNG
    only, the fused AdamW: the resumed run's losses are the uninterrupted run's."""
    from meshlm.config import load_config
    from meshlm.train.trainer import Trainer

    corpus = _corpus(tmp_path)

    def cfg(name):
        return load_config(overrides=[*SMALL, f"data.path={corpus}", f"train.run_dir={tmp_path / name}",
                                      "train.steps=6", "train.checkpoint_interval=3", "train.async_checkpoint=true",
                                      "train.device=cuda"])

    straight = Trainer(cfg("straight"))
    assert all(g.get("fused") for g in straight.optimizer.param_groups)
    straight.train()
    Trainer(cfg("split")).train(until_step=3)
    second = Trainer(cfg("split"), resume=True)
    assert second.step == 3
    second.train()
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert len(a) == len(b) == 6 and max(abs(x - y) / abs(x) for x, y in zip(a, b)) < 1e-4, (a, b)


def test_moe_trains_on_cuda_in_bf16(tmp_path):
    from meshlm.config import load_config
    from meshlm.train.trainer import Trainer

    run_dir = tmp_path / "moe"
    Trainer(load_config(overrides=[*SMALL, f"data.path={_corpus(tmp_path)}", f"train.run_dir={run_dir}",
                                   "train.steps=8", "train.device=cuda", "train.precision=bf16",
                                   "model.num_experts=4", "model.num_experts_per_token=2",
                                   "model.moe_intermediate_size=64"])).train()
    losses = _losses(run_dir)
    assert len(losses) == 8 and all(x == x for x in losses) and losses[-1] < losses[0], losses


def test_meshlm_train_through_the_launcher_on_one_gpu(tmp_path):
    """`meshlm train --nproc 1` on CUDA: torch elastic, NCCL (a world of one), the device picked by local rank;
    the log carries tokens/s, MFU and memory."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", "1",
            *[a for o in [*SMALL, f"data.path={_corpus(tmp_path)}", f"train.run_dir={run_dir}", "train.steps=4",
                          "train.device=cuda", "train.precision=bf16"] for a in ("--set", o)]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from runs import rows

    steps = [r for r in rows(run_dir) if "loss" in r]
    assert len(steps) == 4 and all(r.get("mfu") is not None and r.get("memory_mib") for r in steps), steps[-1]


def test_speculative_greedy_on_cuda_equals_plain_greedy(tmp_path):
    from tiny_hf import make_model_dir

    from meshlm import LLM, SamplingParams

    model_dir = make_model_dir(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["hello world hello world hello", "the quick brown fox jumps over the lazy dog the quick"]
    plain = LLM(str(model_dir), device="cuda", dtype=torch.float32).generate(prompts, greedy)
    spec = LLM(str(model_dir), device="cuda", dtype=torch.float32,
               speculative={"method": "ngram", "num_speculative_tokens": 3}).generate(prompts, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_pairs_use_cudas_flash_kernel_in_bf16(monkeypatch, causal):
    """Ring / all-gather attention's pairs on CUDA in bf16: the flash kernel (its output bf16, its log-sum-exp
    fp32) agrees with the explicit fp32 computation, forward and backward."""
    from meshlm.parallel import pair_attention as pa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = [torch.randn(2, 4, 128, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
    assert pa._kernel(q, None) == "cuda"
    out, lse, aux = pa.pair_forward(q, k, v, causal=causal, scale=0.125)
    grads = pa.pair_backward(dout, q, k, v, out, lse, causal=causal, scale=0.125, aux=aux)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    monkeypatch.setattr(pa, "_kernel", lambda q, allowed: None)
    ref, ref_lse, _ = pa.pair_forward(q, k, v, causal=causal, scale=0.125)
    ref_grads = pa.pair_backward(dout, q, k, v, out, lse, causal=causal, scale=0.125)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b, rtol=0, atol=1e-1)


def test_kv_tiers_on_cuda_give_the_same_greedy_tokens(tmp_path):
    """KV tiers under a GPU cache: host buffers pinned, copies device <-> host on a side stream, to and from disk;
    multi-turn prompts on a small pool give the tokens of the run without tiers, with hits from both tiers, and
    after a restart."""
    from test_kv_tiers import SMALL_POOL, conversations, run
    from tiny_hf import make_model_dir

    from meshlm import LLM

    model_dir = str(make_model_dir(tmp_path))
    for dtype in (torch.float32, torch.bfloat16):
        pool = {**SMALL_POOL, "dtype": dtype}
        want = run(LLM(model_dir, device="cuda", **pool), conversations())
        disk = dict(kv_disk_dir=str(tmp_path / str(dtype)), kv_disk_mb=1)
        llm = LLM(model_dir, device="cuda", kv_host_mb=0.01, **disk, **pool)
        store = llm.engine.runner.tier_store
        assert store.host.is_pinned() and store.copy_stream is not None  # DMA copies on a side stream
        assert run(llm, conversations()) == want, dtype
        s = llm.engine.stats()
        assert s["kv_host_hit_tokens"] > 0 and s["kv_disk_hit_tokens"] > 0, s
        again = LLM(model_dir, device="cuda", **disk, **pool)
        assert run(again, conversations()) == want, dtype
        assert again.engine.stats()["kv_disk_hit_tokens"] > s["kv_disk_hit_tokens"]


def test_a_blocking_wait_raises_at_a_collective_the_device_never_finishes():
    """parallel.collective_wait = "blocking": the host polls the CUDA event recorded after a collective and raises
    CollectiveError past the timeout (here the stream is held by a long sleep kernel, as by a collective a peer
    never joined); once the device passes the event the wait returns."""
    from meshlm import comm

    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e9))  # several seconds of GPU cycles on the current stream
    held = torch.cuda.Event()
    held.record()
    start = time.monotonic()
    with pytest.raises(comm.CollectiveError, match=r"rank 0: all_reduce on mesh axis 'dp'.*collective_wait=blocking"):
        comm._await_device(held, 0.3, (0, [0, 1]), "all_reduce", "dp")
    assert time.monotonic() - start >= 0.3
    torch.cuda.synchronize()
    comm._await_device(held, 0.3, (0, [0, 1]), "all_reduce", "dp")  # passed: returns


# -- several GPUs: NCCL ---------------------------------------------------------------------------------------

LAYOUTS = {  # name -> (GPUs, overrides)
    "pp2 gpipe": (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "pp2 1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "pp2 interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_chunks=2"]),
    "pp2 zero_bubble": (2, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble"]),
    "cp2 ring": (2, ["parallel.cp=2", "parallel.cp_method=ring"]),
    "ep2": (2, ["parallel.ep=2", "model.num_experts=4", "model.num_experts_per_token=2",
                "model.moe_intermediate_size=64"]),
    "tp2 x zero3": (4, ["parallel.tp=2", "parallel.zero_stage=3"]),
}


def test_the_planner_predicts_a_training_step_of_llama3_8b_layers_on_this_gpu():
    """benchmarks/train_step.py times 4 of Llama 3 8B's layers with its 128k vocabulary (2 x 4096 tokens, bf16,
    eager) and prints the planner's step time for the same job on this GPU's preset beside it."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--preset", "llama3-8b",
                          "--set", "num_layers=4", "--device", "cuda", "--batch", "2", "--seq-len", "4096",
                          "--steps", "3", "--warmup", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    if "planner" not in result:
        pytest.skip(f"no planner preset for {result['device_name']}")
    ratio = result["planner"]["step_time_s"]["ratio"]
    print(json.dumps(result["planner"]))
    assert 0.75 <= ratio <= 1.33, result["planner"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nccl_layouts_train(tmp_path, name):
    gpus, overrides = LAYOUTS[name]
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} GPUs, {GPUS} visible")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", str(gpus),
            "--set", f"data.path={_corpus(tmp_path)}", "--set", f"train.run_dir={run_dir}", "--set", "train.steps=6", "--set", "train.device=cuda",
            "--set", "train.precision=bf16", *[a for o in [*SMALL, *overrides] for a in ("--set", o)]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = _losses(run_dir)
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_a_tp2_server_on_gpus_idle_past_its_timeout_answers(tmp_path):
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, {GPUS} visible")
    httpx = pytest.importorskip("httpx")
    from test_server import make_model_dir, serve_argv, server_process

    from meshlm.processes import free_port

    model_dir = make_model_dir(tmp_path)
    port = free_port()
    argv = [a if a != "cpu" else "cuda" for a in serve_argv(model_dir, port, "--tp", "2", "--collective-timeout", "10")]
    with server_process(argv, port) as (_, url):
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(20)
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_stopped_rank_under_blocking_waits_fails_the_run_at_its_collective(tmp_path):
    """`parallel.collective_wait=blocking` on NCCL: rank 1 is SIGSTOPped mid-run; rank 0 raises at the collective
    that does not complete, naming the op, the mesh axis and rank 1 as not responding, within the timeout plus a
    few seconds (NCCL itself would wait for its watchdog)."""
    import os
    import signal

    from meshlm.processes import alive, children
    from runs import ranks_when

    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, {GPUS} visible")
    run_dir, timeout = tmp_path / "run", 10
    small = [o for o in SMALL if not o.startswith("parallel.collective_timeout_s")]
    argv = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", "2",
            *[a for o in [*small, f"data.path={_corpus(tmp_path)}", f"train.run_dir={run_dir}", "train.steps=2000",
                          "train.device=cuda", "train.checkpoint_interval=0", f"parallel.collective_timeout_s={timeout}",
                          "parallel.collective_wait=blocking"] for a in ("--set", o)]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        ranks = ranks_when(proc, lambda: _steps_logged(run_dir) >= 2, timeout_s=180)
        if ranks:
            stopped, stopped_at = ranks[1], time.time()
            os.kill(stopped, signal.SIGSTOP)
        assert stopped is not None, "the run never reached step 2"
        proc.wait(timeout=120)
        elapsed = time.time() - stopped_at
        _, err = proc.communicate()
    finally:
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGCONT)
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode != 0
    assert "collective_wait=blocking" in err and "rank 1" in err, err[-3000:]
    assert elapsed < timeout + 15, (elapsed, err[-3000:])
