"""Retrieval-augmented generation benchmark of meshlm, printed as JSON.

    python benchmarks/rag.py                         # CPU, a few minutes
    python benchmarks/rag.py --sizes 10000 100000 --queries 500

retrieval: for each --sizes N, a generated corpus of N one-chunk documents (about 50 words each, one unique
fact per document) indexed with `meshlm.infer.rag.build_index` (BM25), then --queries questions searched one
at a time: latency p50/p99 (ms), index build seconds, and recall@4 of the document holding the fact.
ttft: `meshlm serve --rag` started as a subprocess on 127.0.0.1 with a tiny random Llama; streamed requests
one at a time: time to first token of the bare question, of the question with 4 retrieved passages (first
time), and of the same question again (its passages already in the prefix cache).
prefix_reuse: `LLM.generate(rag=...)` on --reuse-questions questions each asked --reuse-repeats times
(shuffled), with prefix caching on and off: requests/s, output tokens/s, and the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import missing_extras, parse_args_smoke, print_smoke_skip
from serve import make_model, meshlm_server  # benchmarks/serve.py: the same tiny model and server

SYLLABLES = ["ka", "lo", "mi", "ter", "zu", "van", "rop", "eli", "dus", "gar", "fen", "qui", "bra", "tol", "nex",
             "sor", "pim", "ula", "dre", "cho"]


def make_docs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))) for _ in range(30000)})
    names: set[str] = set()
    docs = []
    for i in range(n):
        name = f"{rng.choice(words)}{i}"  # the number makes it unique
        names.add(name)
        filler = " ".join(rng.choice(words) for _ in range(45))
        docs.append({"id": f"d{i}", "title": f"Note {i}", "text": f"{name} keeps the key in {rng.choice(words)}. {filler}",
                     "question": f"Where does {name} keep the key?"})
    return docs


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def write_jsonl(path: Path, docs: list[dict]) -> None:
    path.write_text("".join(json.dumps({k: d[k] for k in ("id", "title", "text")}) + "\n" for d in docs))


def retrieval(size: int, queries: int, tmp: Path, seed: int) -> dict:
    from meshlm.infer.rag import RagIndex, build_index

    docs = make_docs(size, seed)
    write_jsonl(tmp / f"docs{size}.jsonl", docs)
    t = time.perf_counter()
    build_index(tmp / f"docs{size}.jsonl", tmp / f"ix{size}", chunk_tokens=64, chunk_overlap=0)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    index = RagIndex.load(tmp / f"ix{size}")
    load_s = time.perf_counter() - t
    rng = random.Random(seed + 1)
    picked = [rng.randrange(size) for _ in range(queries)]
    index.search(docs[0]["question"])  # warm-up
    lat, hits = [], 0
    for i in picked:
        t = time.perf_counter()
        found = index.search(docs[i]["question"], top_k=4)
        lat.append(time.perf_counter() - t)
        hits += any(p.doc_id == docs[i]["id"] for p in found)
    return {"chunks": len(index), "queries": queries, "p50_ms": round(1e3 * pct(lat, 0.5), 3),
            "p99_ms": round(1e3 * pct(lat, 0.99), 3), "mean_ms": round(1e3 * statistics.mean(lat), 3),
            "recall_at_4": round(hits / queries, 4), "build_s": round(build_s, 2), "load_s": round(load_s, 2)}


async def _ttft(client, body: dict) -> float:
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if data["choices"] and data["choices"][0].get("text"):
                    return time.perf_counter() - sent
    raise RuntimeError("no token came back")


def ttft(model: Path, index: Path, docs: list[dict], n: int, threads: int) -> dict:
    import httpx

    with meshlm_server(["--model", str(model), "--served-model-name", "bench", "--rag", str(index), "--quiet"],
                       threads=threads) as url:
        async def run() -> dict:
            out = {"no_rag": [], "rag_first": [], "rag_repeat": []}
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                base = {"model": "bench", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
                await _ttft(client, {**base, "prompt": "warm up"})
                for d in docs[:n]:
                    out["no_rag"].append(await _ttft(client, {**base, "prompt": d["question"]}))
                    out["rag_first"].append(await _ttft(client, {**base, "prompt": d["question"], "rag": {"top_k": 4}}))
                    out["rag_repeat"].append(await _ttft(client, {**base, "prompt": d["question"], "rag": {"top_k": 4}}))
                metrics = (await client.get("/metrics")).text
            res = {k: {"p50_ms": round(1e3 * pct(v, 0.5), 2), "mean_ms": round(1e3 * statistics.mean(v), 2)}
                   for k, v in out.items()}
            for line in metrics.splitlines():
                for name in ("meshlm_rag_retrieved_tokens_sum", "meshlm_rag_retrieved_tokens_count",
                             "meshlm_rag_prefix_cache_hit_rate"):
                    if line.startswith(name + " "):
                        res[name] = float(line.split()[-1])
            return res

        return asyncio.run(run())


def prefix_reuse(model: Path, index: Path, docs: list[dict], questions: int, repeats: int, output_len: int,
                 seed: int) -> dict:
    from meshlm import LLM, SamplingParams
    from meshlm.infer.rag import RagIndex

    rag = RagIndex.load(index)
    rng = random.Random(seed)
    prompts = [d["question"] for d in docs[:questions]] * repeats
    rng.shuffle(prompts)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    result = {"requests": len(prompts), "distinct_questions": questions, "output_len": output_len}
    for caching in (True, False):
        llm = LLM(str(model), device="cpu", enable_prefix_caching=caching, max_num_seqs=16)
        llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=2))
        t = time.perf_counter()
        outs = llm.generate(prompts, params, rag=rag, rag_top_k=4)
        wall = time.perf_counter() - t
        result["prefix_cache_on" if caching else "prefix_cache_off"] = {
            "requests_per_s": round(len(outs) / wall, 2),
            "output_tokens_per_s": round(sum(len(o.token_ids) for o in outs) / wall, 1),
            "mean_prompt_tokens": round(statistics.mean(len(o.prompt_token_ids) for o in outs), 1),
            "prefix_cache_hit_rate": round(llm.engine.block_manager.hit_rate, 4), "seconds": round(wall, 2)}
    on, off = result["prefix_cache_on"], result["prefix_cache_off"]
    result["speedup"] = round(on["requests_per_s"] / off["requests_per_s"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000], help="chunks per retrieval index")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--ttft-requests", type=int, default=12)
    ap.add_argument("--serve-docs", type=int, default=2000, help="documents of the index the server uses")
    ap.add_argument("--reuse-questions", type=int, default=8)
    ap.add_argument("--reuse-repeats", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a busy machine)")
    ap.add_argument("--seed", type=int, default=0)
    # --smoke: one index of 200 chunks, 5 queries, a 1-layer model of hidden 32, 2 requests of 2 tokens
    args = parse_args_smoke(ap, dict(sizes=[200], queries=5, hidden=32, layers=1, vocab=256, ttft_requests=2,
                                     serve_docs=50, reuse_questions=2, reuse_repeats=2, output_len=2))
    if args.smoke and (missing := missing_extras("transformers", "tokenizers", "fastapi", "uvicorn", "httpx")):
        print_smoke_skip("rag", {"everything": f"needs {', '.join(missing)} (pip install -e \".[hf,serve]\")"})
        return
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        result = {"retrieval": {str(n): retrieval(n, args.queries, tmp, args.seed) for n in args.sizes}}
        from meshlm.infer.rag import build_index

        docs = make_docs(args.serve_docs, args.seed + 7)
        write_jsonl(tmp / "serve.jsonl", docs)
        build_index(tmp / "serve.jsonl", tmp / "serve-ix", chunk_tokens=64, chunk_overlap=0)
        model = tmp / "model"
        model.mkdir()
        vocab = make_model(model, hidden=args.hidden, layers=args.layers, vocab=args.vocab, max_len=2048)
        result["model"] = {"hidden": args.hidden, "layers": args.layers, "vocab": vocab, "device": "cpu",
                           "torch_threads": torch.get_num_threads()}
        result["ttft"] = ttft(model, tmp / "serve-ix", docs, args.ttft_requests, args.threads)
        result["prefix_reuse"] = prefix_reuse(model, tmp / "serve-ix", docs, args.reuse_questions, args.reuse_repeats,
                                              args.output_len, args.seed)
    print(json.dumps({**result, "smoke": args.smoke}, indent=2))


if __name__ == "__main__":
    main()
