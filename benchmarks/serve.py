"""Inference benchmark of meshlm's engine on one tiny random Llama, printed as JSON.

    python benchmarks/serve.py                       # CPU, a few minutes at most
    python benchmarks/serve.py --num-prompts 64 --output-len 64 --rate 4

Offline: output tokens/s of `LLM.generate` on --num-prompts prompts of random lengths (continuous
batching, paged KV cache) against transformers' `generate` on the same prompts as one left-padded
batch (same weights, greedy, fixed output length), plus how many of the outputs agree token for token.
Online: `meshlm serve` started as a subprocess on 127.0.0.1, requests streamed at Poisson arrivals of
--rate requests/s; mean and p99 time to first token (TTFT: request sent -> first streamed text) and
time per output token (TPOT: (last chunk - first chunk) / (tokens - 1)).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


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


def offline(path: Path, prompts: list[list[int]], output_len: int) -> dict:
    import transformers

    from meshlm import LLM, SamplingParams

    llm = LLM(str(path))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up on prompts that share no prefix with the measured ones (no prefix-cache help).
    llm.generate([[1] * n for n in (5, 40, 90)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine, runner = llm.engine, llm.engine.runner
    before = dict(engine.seconds), runner.attention_seconds
    t = time.perf_counter()
    ours = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t
    split = {k: engine.seconds[k] - before[0][k] for k in engine.seconds}
    attention = runner.attention_seconds - before[1]
    split = {"model_without_attention": split["model"] - attention, "attention": attention,
             "scheduler": split["schedule"], "sampling": split["sampling"],
             "rest (detokenize, stop strings, outputs)": ours_s - split["model"] - split["schedule"] - split["sampling"]}

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        tokens[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    gen = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(tokens[:4], attention_mask=mask[:4], **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
        t = time.perf_counter()
        out = hf.generate(tokens, attention_mask=mask, **gen)
        hf_s = time.perf_counter() - t
        cb_s, cb_same = None, None
        if hasattr(hf, "generate_batch"):  # transformers' own continuous batching (paged attention)
            config = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                                   do_sample=False, eos_token_id=None, pad_token_id=0)
            try:
                hf.generate_batch(prompts[:4], generation_config=config)
                t = time.perf_counter()
                batch = hf.generate_batch(prompts, generation_config=config)
                cb_s = time.perf_counter() - t
                cb_tokens = [o.generated_tokens for o in sorted(batch.values(), key=lambda o: int(o.request_id.split("_")[-1]))]
                cb_same = f"{sum(a == r.token_ids for a, r in zip(cb_tokens, ours))}/{len(prompts)}"
            except Exception as e:  # an API that moved between versions: say so in the JSON
                cb_same = f"not run: {type(e).__name__}: {str(e)[:120]}"
    total = len(prompts) * output_len
    same = sum(out[i, width:].tolist() == r.token_ids for i, r in enumerate(ours))
    return {"num_prompts": len(prompts), "output_len": output_len, "output_tokens": total,
            "meshlm_tokens_per_s": round(total / ours_s, 1), "meshlm_seconds": round(ours_s, 3),
            "transformers_padded_tokens_per_s": round(total / hf_s, 1), "transformers_seconds": round(hf_s, 3),
            "speedup": round(hf_s / ours_s, 3), "greedy_outputs_identical": f"{same}/{len(prompts)}",
            "transformers_continuous_batching_tokens_per_s": round(total / cb_s, 1) if cb_s else None,
            "speedup_vs_continuous_batching": round(cb_s / ours_s, 3) if cb_s else None,
            "continuous_batching_outputs_identical": cb_same,
            "meshlm_step_time_split_s": {k: round(v, 3) for k, v in split.items()},
            "engine_steps": llm.engine.num_steps}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def meshlm_server(serve_args: list[str], *, threads: int, timeout_s: float = 180):
    """`meshlm serve SERVE_ARGS` on a free port in a subprocess with `threads` intra-op threads; yields its
    URL once /health answers, and stops it on exit."""
    import httpx

    port = free_port()
    argv = [*serve_args, "--port", str(port)]
    code = (f"import torch; torch.set_num_threads({threads}); from meshlm.cli import main; "
            f"raise SystemExit(main(['serve', *{argv!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"meshlm serve did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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


async def online_run(url: str, prompts: list[list[int]], output_len: int, rate: float, seed: int) -> list[dict]:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_request(client, [1] * 8, 2)  # warm-up
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, p, output_len)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def online(path: Path, prompts: list[list[int]], output_len: int, rate: float, seed: int, threads: int) -> dict:
    with meshlm_server(["--model", str(path), "--served-model-name", "bench"], threads=threads) as url:
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
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.0, help="online arrivals per second (Poisson)")
    ap.add_argument("--online-requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of both engines and of the server (default 1: comparable on a busy machine)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        vocab = make_model(path, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                           max_len=args.max_len + args.output_len + 16)
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
                   for _ in range(max(args.num_prompts, args.online_requests))]
        result = {
            "model": {"hidden": args.hidden, "layers": args.layers, "vocab": vocab, "device": "cpu",
                      "torch_threads": torch.get_num_threads()},
            "offline": offline(path, prompts[:args.num_prompts], args.output_len),
            "online": online(path, prompts[:args.online_requests], args.output_len, args.rate, args.seed,
                             torch.get_num_threads()),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
