"""Inference benchmark of meshlm's engine on one tiny random Llama, printed as JSON.

    python benchmarks/serve.py                       # CPU, a few minutes at most
    python benchmarks/serve.py --num-prompts 64 --output-len 64 --rate 4

Offline: output tokens/s of `LLM.generate` on --num-prompts prompts of random lengths (continuous
batching, paged KV cache) against transformers' `generate` on the same prompts as one left-padded
batch (same weights, greedy, fixed output length), plus how many of the outputs agree token for token.
Online: `meshlm serve` started as a subprocess on 127.0.0.1 and warmed with one short request per prompt length,
then requests streamed at Poisson arrivals of --rate requests/s; mean and p99 time to first token (TTFT: request
sent -> first streamed text) and time per output token (TPOT: (last chunk - first chunk) / (tokens - 1)).
Several ranks (each a process with one intra-op thread, gloo on 127.0.0.1), smaller sizes (--par-*):
  parallel_offline  at (tp, cp) in --layouts: the ranks are spawned here, each builds `LLM(..., tp=, cp=)`,
                    rank 0 times `generate`'s loop on the same prompt lengths (greedy, ignore_eos; --repeats
                    runs, the fastest counts); tok/s, mean TTFT and TPOT, and whether the tokens equal the
                    (1, 1) run's.
  parallel_online   the same layouts through `meshlm serve --tp --cp` (it launches its ranks itself):
                    TTFT/TPOT as above; every process of the server is stopped afterwards.
  planner           `meshlm plan infer --cluster local`'s prediction of the two parts above (fp32, meshlm's engine
                    priced from --calibration, a `meshlm plan calibrate` file; skipped when absent): throughput,
                    TTFT and TPOT predicted / measured per layout (parallel_offline's TTFT/TPOT timed per step),
                    on the recorded cores and, as `on_cores_left`, on those less the cores other work on the
                    host took during the run (`other_work_cores` of each part, online the benchmark's own client
                    among it: the host shares its cores).
  longest_context   a fixed per-rank KV budget (--kv-blocks-per-rank blocks of 16 tokens) at cp 1/2/4:
                    the longest prompt + generation the block arithmetic allows (blocks per rank x cp x
                    block size), served at that length (tokens compared with one process with a large
                    budget) and refused one token longer; one rank alone refuses the cp=4 length.
On a CPU the ranks share its cores: multi-rank tok/s measures correctness and overhead, not speedup.

    python benchmarks/serve.py --parts parallel_offline,longest_context --layouts 1x1,2x1,1x2,2x2
The default run takes about 4 minutes on 2 CPU cores (most of it the offline part and transformers' continuous
batching).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from _common import (OtherWork, meshlm_on_this_machine, missing_extras, parse_args_smoke, predicted_vs_measured,
                     print_result, print_smoke_skip, run_ranks, stepped_generate)
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_modes import estimate_serving
from meshlm.planner.serving_workload import Workload
from meshlm.processes import free_port, stop_tree

BLOCK_SIZE = 16  # tokens per KV block in the longest-context part

def make_model(path: Path, *, hidden: int, layers: int, vocab: int, max_len: int) -> int:
    """A tiny random Llama + a byte-level BPE tokenizer trained on some of Python's own sources."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [p.read_text(errors="ignore") for p in sorted(Path(argparse.__file__).parent.glob("*.py"))[:60]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=3 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                                   num_key_value_heads=max(1, hidden // 64), max_position_embeddings=max_len,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return tok.get_vocab_size()


def shifted(prompts: list[list[int]], shift: int, vocab: int) -> list[list[int]]:
    """The same prompt lengths with other token ids: a repeat that the prefix cache cannot shortcut."""
    return [[(t - 2 + shift) % (vocab - 2) + 2 for t in p] for p in prompts]


def timed(fn) -> tuple[float, float, int, object]:
    """(wall seconds, CPU seconds of this process, page faults it took, result) of `fn()`."""
    faults, cpu, wall = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
    out = fn()
    return (time.perf_counter() - wall, time.process_time() - cpu,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, out)


def transformers_worker(conn, path: str, threads: int, same_malloc: bool) -> None:
    """transformers' generation in a process of its own, so that its malloc is what a transformers user
    gets (meshlm's `LLM` raises glibc's malloc thresholds for its whole process; `same_malloc` sets them
    here too). Receives (kind, prompts, output_len) and answers timed(...) with the tokens as lists."""
    import transformers

    torch.set_num_threads(threads)
    if same_malloc:
        from meshlm.host_memory import reuse_freed_host_memory
        reuse_freed_host_memory()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def padded(ps: list[list[int]], output_len: int) -> list[list[int]]:
        width = max(map(len, ps))
        tokens = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, p in enumerate(ps):  # left padding, as decoder-only generation needs
            tokens[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = hf.generate(tokens, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    def continuous(ps: list[list[int]], output_len: int):
        """transformers' own continuous batching (paged attention), where this version has it."""
        if not hasattr(hf, "generate_batch"):
            return None
        config = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                               do_sample=False, eos_token_id=None, pad_token_id=0)
        try:
            with torch.no_grad():
                batch = hf.generate_batch(ps, generation_config=config)
            return [o.generated_tokens for o in sorted(batch.values(), key=lambda o: int(o.request_id.split("_")[-1]))]
        except Exception as e:  # an API that moved between versions: say so in the JSON
            return f"not run: {type(e).__name__}: {str(e)[:120]}"

    while (job := conn.recv()) is not None:
        kind, ps, output_len = job
        conn.send(timed(lambda: (padded if kind == "padded" else continuous)(ps, output_len)))


@contextlib.contextmanager
def transformers_process(path: Path, *, same_malloc: bool):
    """A running `transformers_worker`; call the yielded function with (kind, prompts, output_len)."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=transformers_worker, args=(there, str(path), torch.get_num_threads(), same_malloc),
                       daemon=True)
    proc.start()

    def run(*job):
        here.send(job)
        return here.recv()

    try:
        yield run
    finally:
        here.send(None)
        proc.join(60)


def offline(path: Path, prompts: list[list[int]], output_len: int, repeats: int, *, continuous: bool = True) -> dict:
    """meshlm's `LLM.generate` and transformers' padded `generate` (and continuous batching, once) on the same
    prompts. Each engine runs `repeats` times on prompts of the same lengths (other token ids each time, so
    meshlm's prefix cache does not help), alternating, and the fastest run of each counts (`timeit`'s rule:
    on a shared machine the slow runs measure the neighbours); the median of the repeats' paired ratios is
    printed too. CPU seconds and page faults are reported beside wall seconds.

    transformers runs in a process of its own, as its users run it: meshlm's `LLM` raises glibc malloc's
    thresholds for its process (`host_memory.py`), which would speed up transformers too. A second
    transformers process with the same malloc thresholds is timed as well, and its ratio printed beside."""
    from meshlm import LLM, SamplingParams

    llm = LLM(str(path))
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    with transformers_process(path, same_malloc=False) as hf, transformers_process(path, same_malloc=True) as hf_same:
        # Warm-up on prompts that share no prefix with the measured ones (no prefix-cache help).
        llm.generate([[1] * n for n in (5, 40, 90)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        hf("padded", prompts[:4], 4), hf_same("padded", prompts[:4], 4)
        engine, runner = llm.engine, llm.engine.runner
        ours_runs, hf_runs, same_runs = [], [], []
        for r in range(repeats):
            ps = shifted(prompts, r, vocab)
            before = dict(engine.seconds), runner.attention_seconds, engine.num_steps
            wall, cpu, faults, out = timed(lambda: llm.generate(ps, params))
            split = {k: engine.seconds[k] - before[0][k] for k in engine.seconds}
            attention = runner.attention_seconds - before[1]
            split = {"model_without_attention": split["model"] - attention, "attention": attention,
                     "scheduler": split["schedule"], "sampling": split["sampling"],
                     "rest (detokenize, stop strings, outputs)": wall - split["model"] - split["schedule"]
                     - split["sampling"]}
            ours_runs.append((wall, cpu, faults, split, out, engine.num_steps - before[2]))
            for worker, runs in ((hf, hf_runs), (hf_same, same_runs)):
                hf_wall, hf_cpu, hf_faults, hf_out = worker("padded", ps, output_len)
                runs.append((hf_wall, hf_cpu, hf_faults, sum(h == o.token_ids for h, o in zip(hf_out, out))))
        if continuous:
            hf("continuous", prompts[:4], output_len)
            cb_s, _, _, cb_tokens = hf("continuous", prompts, output_len)
        else:
            cb_s, cb_tokens = None, "not run (--smoke)"
    ours_s, ours_cpu, ours_faults, split, _, steps = min(ours_runs, key=lambda run: run[0])
    hf_s, hf_cpu, hf_faults, _ = min(hf_runs, key=lambda run: run[0])
    same_s = min(run[0] for run in same_runs)
    same = min(run[3] for run in hf_runs + same_runs)
    if isinstance(cb_tokens, list):
        cb_same = f"{sum(a == r.token_ids for a, r in zip(cb_tokens, ours_runs[0][4]))}/{len(prompts)}"
    else:
        cb_s, cb_same = None, cb_tokens
    total = len(prompts) * output_len
    return {"num_prompts": len(prompts), "output_len": output_len, "output_tokens": total, "repeats": repeats,
            "meshlm_tokens_per_s": round(total / ours_s, 1), "meshlm_seconds": round(ours_s, 3),
            "meshlm_cpu_seconds": round(ours_cpu, 3), "meshlm_page_faults": ours_faults,
            "transformers_padded_tokens_per_s": round(total / hf_s, 1), "transformers_seconds": round(hf_s, 3),
            "transformers_cpu_seconds": round(hf_cpu, 3), "transformers_page_faults": hf_faults,
            "speedup": round(hf_s / ours_s, 3), "speedup_cpu_seconds": round(hf_cpu / ours_cpu, 3),
            # each repeat runs the engines back to back: the median of those paired ratios follows slow
            # drifts of a shared machine less than the ratio of the fastest runs
            "speedup_paired_median": round(statistics.median(h[0] / o[0] for o, h in zip(ours_runs, hf_runs)), 3),
            # transformers with the malloc thresholds meshlm's LLM sets (not what its users get by default)
            "transformers_same_malloc_tokens_per_s": round(total / same_s, 1),
            "speedup_vs_transformers_same_malloc": round(same_s / ours_s, 3),
            "every_run_s": {"meshlm": [round(run[0], 3) for run in ours_runs],
                            "transformers_padded": [round(run[0], 3) for run in hf_runs],
                            "transformers_padded_same_malloc": [round(run[0], 3) for run in same_runs]},
            "greedy_outputs_identical": f"{same}/{len(prompts)}",
            "transformers_continuous_batching_tokens_per_s": round(total / cb_s, 1) if cb_s else None,
            "speedup_vs_continuous_batching": round(cb_s / ours_s, 3) if cb_s else None,
            "continuous_batching_outputs_identical": cb_same,
            "meshlm_step_time_split_s": {k: round(v, 3) for k, v in split.items()},
            "engine_steps": steps}


@contextlib.contextmanager
def meshlm_server(serve_args: list[str], *, threads: int, timeout_s: float = 180, stopped: dict | None = None):
    """`meshlm serve SERVE_ARGS` on a free port in a subprocess (in a session of its own) with `threads`
    intra-op threads (ranks started by --tp/--cp take one each); yields its URL once /health answers,
    and stops it and every rank it started on exit (how that went is put in `stopped`)."""
    from meshlm.infer.client import ServerNotReady, wait_until_healthy

    port = free_port()
    argv = [*serve_args, "--port", str(port), "--quiet"]
    code = (f"import torch; torch.set_num_threads({threads}); from meshlm.cli import main; "
            f"raise SystemExit(main(['serve', *{argv!r}]))")
    errors = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the server runs
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=errors,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(url, timeout_s=timeout_s, proc=proc, poll_s=0.2)
        except ServerNotReady as e:
            errors.seek(0)
            raise RuntimeError(f"meshlm serve did not start: {errors.read().decode()[-2000:]}") from e
        yield url
    finally:
        (stopped if stopped is not None else {}).update(stop_tree(proc, 30))
        errors.close()


async def one_request(client, prompt: list[int], output_len: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            now = time.perf_counter()
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            elif data["choices"] and (data["choices"][0].get("text") or data["choices"][0].get("finish_reason")):
                first = first or now
                last = now
    return {"ttft": first - sent, "tpot": (last - first) / max(tokens - 1, 1), "tokens": tokens}


async def warm_up(url: str, prompts: list[list[int]], vocab: int) -> None:
    """One short request per prompt length, other token ids (`shifted`: nothing for the prefix cache), one at a time:
    the server's first prompt of a length pays one-time costs that a warm server does not (the offline parts count
    their fastest repeat for the same reason)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for p in {len(p): p for p in shifted(prompts, 1, vocab)}.values():
            await one_request(client, p, 2)


async def online_run(url: str, prompts: list[list[int]], output_len: int, rate: float, seed: int) -> list[dict]:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, p, output_len)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def online(path: Path, prompts: list[list[int]], output_len: int, rate: float, seed: int, threads: int,
           extra_args: tuple[str, ...] = ()) -> dict:
    """`meshlm serve` warmed over the prompts' lengths (`warm_up`), then the prompts at Poisson arrivals of `rate`
    (`online_run`); the other work on the host during the timed run counts this process, the client, too."""
    stopped = {}
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    with meshlm_server(["--model", str(path), "--served-model-name", "bench", *extra_args], threads=threads,
                       stopped=stopped) as url:
        asyncio.run(warm_up(url, prompts, vocab))
        with OtherWork(os.getpid(), root_is_other=True) as other:  # the server below this process; the client in it
            t = time.perf_counter()
            results = asyncio.run(online_run(url, prompts, output_len, rate, seed))
            wall = time.perf_counter() - t

    def p99(xs):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]

    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    return {"num_requests": len(results), "rate_per_s": rate, "output_len": output_len,
            "ttft_mean_ms": round(1e3 * statistics.mean(ttft), 1), "ttft_p99_ms": round(1e3 * p99(ttft), 1),
            "tpot_mean_ms": round(1e3 * statistics.mean(tpot), 2), "tpot_p99_ms": round(1e3 * p99(tpot), 2),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1), "server_stopped": stopped,
            "other_work_cores": other.cores and round(other.cores, 2)}


def layout_name(tp: int, cp: int) -> str:
    return f"tp{tp}_cp{cp}"


def generate_on_ranks(rank: int, world_size: int, job: argparse.Namespace) -> dict:
    """One rank of `parallel_offline` (spawned by `run_ranks`): rank 0 times `generate` and returns it."""
    from meshlm import LLM, SamplingParams

    llm = LLM(str(job.path), tp=job.tp, cp=job.cp, device="cpu")
    if not llm.is_driver:
        return {}
    try:
        # warm-up on prompts that share no prefix with the measured ones
        llm.generate([[1] * n for n in (5, 40)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        # `repeats` runs on prompts of the same lengths (other token ids each time: no prefix-cache help); the
        # fastest counts (timeit's rule: the first run of a shape pays one-time allocations, and on a shared
        # machine the slow runs measure the neighbours)
        vocab = llm.engine.model.config.vocab_size
        runs = [stepped_generate(llm.engine, shifted(job.prompts, r, vocab), job.output_len) for r in range(job.repeats)]
        seconds, ttft, tpot, _, core_share, other = min(runs, key=lambda run: run[0])
        token_ids = runs[0][3]
        scheduler = llm.engine.scheduler
    finally:
        llm.close()
    total = len(job.prompts) * job.output_len
    return {"tokens_per_s": round(total / seconds, 1), "seconds": round(seconds, 3), "output_tokens": total,
            "every_run_s": [round(run[0], 3) for run in runs], "rank0_core_share": round(core_share, 2),
            "other_work_cores": other and round(other, 2),
            "ttft_mean_ms": round(1e3 * statistics.mean(ttft), 2), "tpot_mean_ms": round(1e3 * statistics.mean(tpot), 2),
            "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "token_ids": token_ids}


def parallel_offline(path: Path, prompts: list[list[int]], output_len: int, layouts: list[tuple[int, int]], *,
                     repeats: int) -> dict:
    results = {}
    for tp, cp in layouts:
        job = argparse.Namespace(device="cpu", path=path, tp=tp, cp=cp, prompts=prompts, output_len=output_len,
                                 repeats=repeats)
        results[layout_name(tp, cp)] = run_ranks(generate_on_ranks, tp * cp, job)
    reference = results[layout_name(1, 1)]["token_ids"] if (1, 1) in layouts else None
    for r in results.values():
        tokens = r.pop("token_ids")
        if reference is not None:
            r["greedy_tokens_equal_tp1_cp1"] = f"{sum(a == b for a, b in zip(tokens, reference))}/{len(prompts)}"
    return {"num_prompts": len(prompts), "output_len": output_len, "layouts": results}


def parallel_online(path: Path, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                    layouts: list[tuple[int, int]]) -> dict:
    return {layout_name(tp, cp): online(path, prompts, output_len, rate, seed, 1,
                                        ("--tp", str(tp), "--cp", str(cp), "--device", "cpu"))
            for tp, cp in layouts}


def longest_on_ranks(rank: int, world_size: int, job: argparse.Namespace) -> dict:
    """One rank of `longest_context`: rank 0 serves the longest prompt + generation the per-rank budget
    allows at this cp, then asks for one token more (which the engine must refuse)."""
    from meshlm import LLM, SamplingParams

    llm = LLM(str(job.path), cp=job.cp, device="cpu", block_size=BLOCK_SIZE, num_blocks=job.blocks_per_rank)
    if not llm.is_driver:
        return {}
    try:
        blocks = llm.engine.block_manager.num_blocks  # over all cp ranks
        longest = blocks * BLOCK_SIZE  # the scheduler admits prompt + max_tokens <= blocks x block size
        prompt = job.tokens[:longest - job.output_len]
        params = SamplingParams(temperature=0, max_tokens=job.output_len, ignore_eos=True)
        t = time.perf_counter()
        served = llm.generate([prompt], params)[0].token_ids
        seconds = time.perf_counter() - t
        try:
            llm.generate([job.tokens[:longest - job.output_len + 1]], params)
            refused = "not refused"
        except ValueError as e:
            refused = f"ValueError: {e}"
    finally:
        llm.close()
    return {"kv_blocks_total": blocks, "longest_tokens_by_block_arithmetic": longest,
            "served_prompt_tokens": len(prompt), "served_new_tokens": len(served), "seconds": round(seconds, 3),
            "one_token_longer": refused, "token_ids": served}


def longest_context(path: Path, tokens: list[int], output_len: int, blocks_per_rank: int, cps: list[int]) -> dict:
    from meshlm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    reference = LLM(str(path), device="cpu")  # one process, a budget large enough for every length here
    results = {}
    for cp in cps:
        job = argparse.Namespace(device="cpu", path=path, cp=cp, blocks_per_rank=blocks_per_rank, tokens=tokens,
                                 output_len=output_len)
        r = run_ranks(longest_on_ranks, cp, job)
        expected = reference.generate([tokens[:r["served_prompt_tokens"]]], params)[0].token_ids
        r["greedy_tokens_equal_one_process_large_budget"] = r.pop("token_ids") == expected
        results[f"cp{cp}"] = r
    base = results.get("cp1", {}).get("longest_tokens_by_block_arithmetic")
    for r in results.values():
        r["longest_vs_cp1"] = round(r["longest_tokens_by_block_arithmetic"] / base, 2) if base else None
    # One rank with the same per-rank budget and the longest cp's length: refused (a ValueError).
    top = results[f"cp{max(cps)}"]
    alone = LLM(str(path), device="cpu", block_size=BLOCK_SIZE, num_blocks=blocks_per_rank)
    try:
        alone.generate([tokens[:top["served_prompt_tokens"]]], params)
        one_rank = "served (unexpected)"
    except ValueError as e:
        one_rank = f"ValueError: {e}"
    return {"block_size": BLOCK_SIZE, "kv_blocks_per_rank": blocks_per_rank,
            "kv_tokens_per_rank": blocks_per_rank * BLOCK_SIZE, "output_len": output_len, "cp": results,
            f"one_rank_same_budget_at_cp{max(cps)}_length": one_rank}


def planner(path: Path, calibration: str, result: dict, *, par_prompts: list[list[int]], output_len: int,
            rate: float) -> dict:
    """The serving planner's prediction of the parallel parts (`meshlm plan infer --cluster local`: fp32, meshlm's
    engine with the host time `meshlm plan calibrate` measured, the ranks time-sharing the recorded cores) at their
    own workload -- prompts of the measured mean length, `output_len` new tokens: parallel_offline as a static batch
    of its prompts (all prefilled in the first step, then decoded together), parallel_online as Poisson arrivals at
    its rate -- beside what was measured, with ratio = predicted / measured (`predicted_vs_measured`), and again
    (`on_cores_left`) with the recorded cores less those other work on the host took during the run."""
    base, skipped = meshlm_on_this_machine(str(path), calibration)
    if base is None:
        return skipped
    cluster = base.cluster
    offline, online = result.get("parallel_offline", {}).get("layouts", {}), result.get("parallel_online", {})
    mean_in = round(statistics.mean(map(len, par_prompts)))
    out = {"cluster": {"matmul_flops": cluster.peak("fp32"), "memory_bandwidth": cluster.hbm_bw,
                       "cores": cluster.compute_slots, "serving_host_s": cluster.serving_host},
           "input_len": mean_in, "output_len": output_len, "precision": "fp32", "engine": "meshlm", "layouts": {}}
    for name in sorted(set(offline) | set(online)):
        tp, cp = (int(x) for x in name.removeprefix("tp").split("_cp"))
        row = out["layouts"][name] = {}
        for part, m in (("offline_static_batch", offline.get(name)), ("online_poisson", online.get(name))):
            if m is None:
                continue
            wl = (Workload(mean_in, output_len, batch=len(par_prompts), max_batch=m["max_num_seqs"],
                           prefill_chunk=m["max_num_batched_tokens"]) if part.startswith("offline")
                  else Workload(mean_in, output_len, request_rate=rate, prefill_chunk=2048, max_batch=64))  # serve's
            # on the recorded cores, and on those that other work left the run (the cores less `other_work_cores`)
            left = (max(0.1, cluster.compute_slots - m["other_work_cores"])
                    if m.get("other_work_cores") is not None and cluster.compute_slots else None)
            sv = replace(base, layout=ServingLayout(tp=tp, cp=cp))
            row[part] = _versus(sv, wl, m, detail=True)
            if left and "bound" in row[part]:
                fewer = replace(sv, cluster=replace(cluster, compute_slots=left))
                row[part]["on_cores_left"] = {"cores": round(left, 2), **_versus(fewer, wl, m)}
    return out


def _versus(sv, wl, m: dict, *, detail: bool = False) -> dict:
    """Serving `sv` under Workload `wl` against measured run `m`, predicted / measured: output tokens/s (online the
    arrivals set it), TTFT, TPOT; `detail` adds the bound and the predicted iteration by component."""
    est = estimate_serving(sv, wl)
    if not est["fits"]:
        return {"predicted": est["reason"]}
    vs = predicted_vs_measured({"output_tokens_per_s": (est["output_tokens_per_s"], m.get("tokens_per_s")),
                                "ttft_ms": (est["ttft_ms"], m["ttft_mean_ms"]), "tpot_ms": (est["tpot_ms"], m["tpot_mean_ms"])})
    return {"bound": est["bound"], **vs, "predicted_iteration_ms": {k: round(v, 3) for k, v in est["iteration_ms"].items()
                                                                    if isinstance(v, float) and v > 0}} if detail else vs


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """"1x1,2x1,1x2" -> [(1, 1), (2, 1), (1, 2)] as (tp, cp)."""
    return [tuple(int(n) for n in item.split("x")) for item in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--hidden", 256), ("--layers", 4), ("--vocab", 1024), ("--num-prompts", 64),
                          ("--min-len", 16), ("--max-len", 256), ("--output-len", 64), ("--online-requests", 32)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--rate", type=float, default=4.0, help="online arrivals per second (Poisson)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="offline runs of each engine (other token ids each time); the fastest counts (default 3)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of both engines and of the server (default 1: comparable on a busy machine)")
    ap.add_argument("--seed", type=int, default=0)
    par = ap.add_argument_group("several ranks (one thread each; scale these up on a machine with the cores)")
    par.add_argument("--layouts", type=parse_layouts, default=parse_layouts("1x1,2x1,1x2"),
                     help="TPxCP layouts of parallel_offline/parallel_online (default 1x1,2x1,1x2)")
    par.add_argument("--par-prompts", type=int, default=8, help="prompts of parallel_offline (default 8)")
    par.add_argument("--par-requests", type=int, default=8, help="requests of parallel_online (default 8)")
    par.add_argument("--par-max-len", type=int, default=64, help="longest of those prompts (default 64)")
    par.add_argument("--par-output-len", type=int, default=16, help="new tokens per prompt (default 16)")
    par.add_argument("--par-rate", type=float, default=2.0, help="parallel_online arrivals per second (default 2)")
    par.add_argument("--kv-blocks-per-rank", type=int, default=4,
                     help=f"longest_context: KV blocks of {BLOCK_SIZE} tokens per rank (default 4)")
    par.add_argument("--context-cps", default="1,2,4", help="longest_context's cp degrees (default 1,2,4)")
    par.add_argument("--long-output-len", type=int, default=8, help="longest_context's new tokens (default 8)")
    ap.add_argument("--parts", default="offline,online,parallel_offline,parallel_online,longest_context,planner",
                    help="which parts run (default: all)")
    ap.add_argument("--calibration", default="plan_calibration.json",
                    help="a `meshlm plan calibrate` file for the planner part (skipped when absent)")
    # --smoke: a 1-layer model of hidden 128 (4 heads, 2 kv heads); 4 prompts of up to 16 tokens, 2 new tokens each,
    # offline (no transformers' continuous batching), online (2 requests), parallel_offline at 1x1, 2x1; no others
    args = parse_args_smoke(ap, dict(hidden=128, layers=1, vocab=256, num_prompts=4, min_len=4, max_len=16,
                                     output_len=2, online_requests=2, rate=50.0, repeats=1, par_prompts=2,
                                     par_max_len=16, par_output_len=2, layouts=parse_layouts("1x1,2x1"),
                                     parts="offline,online,parallel_offline,planner"))
    if args.smoke and (missing := missing_extras("transformers", "tokenizers", "fastapi", "uvicorn", "httpx")):
        print_smoke_skip("serve", {"everything": f"needs {', '.join(missing)} (pip install -e \".[hf,serve]\")"})
        return
    parts = set(args.parts.split(","))
    cps = [int(c) for c in args.context_cps.split(",")]
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    longest = max(cps) * args.kv_blocks_per_rank * BLOCK_SIZE
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        vocab = make_model(path, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                           max_len=max(args.max_len + args.output_len, args.par_max_len + args.par_output_len,
                                       longest) + 16)
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
                   for _ in range(max(args.num_prompts, args.online_requests))]
        par_prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(args.min_len, args.par_max_len))]
                       for _ in range(max(args.par_prompts, args.par_requests))]
        cores = len(os.sched_getaffinity(0))
        result = {
            "model": {"hidden": args.hidden, "layers": args.layers, "vocab": vocab, "device": "cpu",
                      "torch_threads": torch.get_num_threads(), "cpu_cores": cores},
            "note": (f"the ranks of a multi-rank layout (one thread each) share this machine's {cores} CPU cores: "
                     "their tok/s measures correctness and overhead (broadcast of each step, collectives), "
                     "not the speedup of separate devices"),
        }
        if "offline" in parts:
            result["offline"] = offline(path, prompts[:args.num_prompts], args.output_len, args.repeats,
                                        continuous=not args.smoke)  # transformers' continuous batching: slow to start
        if "online" in parts:
            result["online"] = online(path, prompts[:args.online_requests], args.output_len, args.rate, args.seed,
                                      torch.get_num_threads())
        if "parallel_offline" in parts:
            result["parallel_offline"] = parallel_offline(path, par_prompts[:args.par_prompts], args.par_output_len,
                                                          args.layouts, repeats=args.repeats)
        if "parallel_online" in parts:
            result["parallel_online"] = parallel_online(path, par_prompts[:args.par_requests], args.par_output_len,
                                                        args.par_rate, args.seed, args.layouts)
        if "longest_context" in parts:
            tokens = [rng.randrange(2, vocab) for _ in range(longest + 1)]
            result["longest_context"] = longest_context(path, tokens, args.long_output_len, args.kv_blocks_per_rank,
                                                        cps)
        if "planner" in parts:
            result["planner"] = planner(path, args.calibration, result, par_prompts=par_prompts[:args.par_prompts],
                                        output_len=args.par_output_len, rate=args.par_rate)
    skipped = {p: "not in --smoke" for p in ("parallel_online", "longest_context") if p not in parts}
    print_result(result, args, started, smoke_skipped=skipped)


if __name__ == "__main__":
    main()
