"""Corpus preparation and training-time reading: `meshlm data prepare` beside Hugging Face `datasets.map`, JSON.

    python benchmarks/data.py                        # a 2048 MB corpus: many minutes on a few cores
    python benchmarks/data.py --size-mb 256 --workers 1,2 --hf-num-procs 1,2
    python benchmarks/data.py --smoke                # 2 MB, seconds (CI)

corpus: --size-mb MB of generated English-like text (Zipf-distributed made-up words in sentences, documents
of 3 to 60 sentences), written once as `corpus.jsonl.zst` and once as `corpus.parquet` (a row group per 2000
documents) in a temp folder; a byte-level BPE of --vocab entries (with "<|endoftext|>") trained on its first
documents. MB/s below counts the documents' UTF-8 text bytes, whatever the file format.
prepare: `meshlm data prepare` (`meshlm.cli.main`, in a fresh `python -c` process each) on the .jsonl.zst with each
--workers count and on the .parquet with the largest: wall seconds end to end (reading, decompressing,
tokenizing, writing shards and manifest), text MB/s, tokens/s, CPU seconds, and the largest resident set of
any one of its processes (the reading process or a worker).
hf_datasets: the same tokenizer through `datasets.load_dataset("parquet")` and `Dataset.map(batched=True,
num_proc=N)` in a fresh `python -c` process each (TOKENIZERS_PARALLELISM=false, as meshlm's workers: N processes, N
cores): load seconds (the conversion to Arrow), map seconds, MB/s of map alone and of load + map.
check: --check-docs documents spread over the corpus: their tokens in every meshlm output and in the
`datasets` output equal `Tokenizer.encode(text).ids + [eos]`; total token counts agree.
read_loop: a training-like loop (`PreparedLoader`, --read-steps steps of --batch samples of --seq-len,
prefetching, a --step-ms sleep standing for the training step) in a fresh process, over the prepared corpus
and over a corpus --rss-scale times larger (the same shards listed that many times, as hard links): resident
memory (anonymous and file-backed) after opening and after the loop, and the wait per batch (the first
batch is never prefetched: reported apart). The page cache is warm (the shards were just written).
The machine's load average is reported: on a shared machine every rate here is a lower bound. `cpu_s` (user +
system seconds of the run's processes; meshlm: all of it, imports included; datasets: load + map) and
`text_mb_per_cpu_s` depend much less on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import missing_extras, parse_args_smoke, print_smoke_skip

import meshlm

LETTERS = "etaoinshrdlcumwfgypbvkjxqz"


# --------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------


def sentence_pool(rng: np.random.Generator, num_sentences: int) -> list[str]:
    """Sentences of 5 to 24 made-up words drawn from a Zipf distribution over 40-some thousand words."""
    p = 1 / np.arange(1, len(LETTERS) + 1)
    lengths = rng.integers(1, 11, size=60_000)
    chars = rng.choice(np.array(list(LETTERS)), size=int(lengths.sum()), p=p / p.sum())
    words = sorted({"".join(w) for w in np.split(chars, np.cumsum(lengths)[:-1])})
    zipf = 1 / np.arange(1, len(words) + 1) ** 1.1
    per_sentence = rng.integers(5, 25, size=num_sentences)
    picks = rng.permutation(len(words))[rng.choice(len(words), size=int(per_sentence.sum()), p=zipf / zipf.sum())]
    ends = rng.choice(np.array([".", ".", ".", "?", "!", ";"]), size=num_sentences)
    pool = []
    for chunk, end in zip(np.split(picks, np.cumsum(per_sentence)[:-1]), ends):
        s = " ".join(words[i] for i in chunk)
        pool.append(s[0].upper() + s[1:] + end)
    return pool


def write_corpus(folder: Path, size_mb: float, *, seed: int, check_docs: int) -> dict:
    """corpus.jsonl.zst and corpus.parquet with the same documents; a few documents kept for the check."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = np.random.default_rng(seed)
    pool = sentence_pool(rng, 100_000)
    target = int(size_mb * 1e6)
    every = max(1, int(target / 3500 / max(check_docs, 1)))  # ~3.5 kB per document
    kept, train_docs, text_bytes, num_docs = {}, [], 0, 0
    writer = pq.ParquetWriter(folder / "corpus.parquet", pa.schema([("text", pa.string())]))
    with open(folder / "corpus.jsonl.zst", "wb") as raw, \
            zstandard.ZstdCompressor(level=3).stream_writer(raw) as zst:
        while text_bytes < target:
            batch = []
            for _ in range(2000):
                doc = " ".join(pool[i] for i in rng.integers(0, len(pool), size=int(rng.integers(3, 61))))
                if num_docs % every == 0 and len(kept) < check_docs:
                    kept[num_docs] = doc
                if len(train_docs) < 2000:
                    train_docs.append(doc)
                batch.append(doc)
                num_docs += 1
                text_bytes += len(doc.encode())
                if text_bytes >= target:
                    break
            zst.write("".join(json.dumps({"text": d}) + "\n" for d in batch).encode())
            writer.write_table(pa.table({"text": batch}))
    writer.close()
    return {"kept": kept, "train_docs": train_docs, "text_bytes": text_bytes, "num_docs": num_docs,
            "jsonl_zst_bytes": (folder / "corpus.jsonl.zst").stat().st_size,
            "parquet_bytes": (folder / "corpus.parquet").stat().st_size}


def train_tokenizer(path: Path, docs: list[str], vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(path))


# --------------------------------------------------------------------------------------------
# Runs, each in a fresh process
# --------------------------------------------------------------------------------------------


# max_rss_mb (PREPARE and HF_MAP below): the largest resident set of the process (VmHWM) or of any of its finished
# children (getrusage), MB. Not the process's own getrusage: Linux carries ru_maxrss over an exec, so it would
# report the size of this benchmark (torch imported), which started it.
# `meshlm data prepare` in a process of its own, started with `-c` so that its spawned workers import only what
# the command imports (a script's main module would be imported again in every worker: this one imports torch).
PREPARE = """
import json, resource, sys, time
from meshlm.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
seconds = time.perf_counter() - start
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
kib = max(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
cpu = sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
print(json.dumps({"exit_code": code, "seconds": seconds, "max_rss_mb": round(kib / 1024, 1), "cpu_s": cpu}))
"""


# The `datasets` run, in a `python -c` process too (the same imports as a user's script; no torch).
HF_MAP = """
import json, os, resource, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # N processes use N cores, as meshlm's workers
import datasets
import pyarrow.compute as pc
from tokenizers import Tokenizer

parquet, tokenizer, num_proc, cache, kept = json.loads(sys.argv[1])
datasets.disable_progress_bars()
tok = Tokenizer.from_file(tokenizer)
eos = tok.token_to_id("<|endoftext|>")


def encode(batch):
    return {"input_ids": [e.ids + [eos] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}


cpu0 = resource.getrusage(resource.RUSAGE_SELF)
cpu0 = cpu0.ru_utime + cpu0.ru_stime  # the imports above are not the work
start = time.perf_counter()
ds = datasets.load_dataset("parquet", data_files=parquet, split="train", cache_dir=cache)
loaded = time.perf_counter()
out = ds.map(encode, batched=True, batch_size=1000, num_proc=num_proc if num_proc > 1 else None,
             remove_columns=["text"])
mapped = time.perf_counter()
num_tokens = int(pc.sum(pc.list_value_length(out.data.column("input_ids"))).as_py())
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
kib = max(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
cpu = sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
print(json.dumps({"load_s": loaded - start, "map_s": mapped - loaded, "num_tokens": num_tokens, "cpu_s": cpu - cpu0,
                  "kept_tokens": {str(i): out[i]["input_ids"] for i in kept}, "max_rss_mb": round(kib / 1024, 1),
                  "datasets_version": datasets.__version__}))
"""


def _read_loop_process(folder: str, args_dict: dict, out_queue) -> None:
    import torch

    from meshlm.data.dataset import PreparedDataset
    from meshlm.data.loader import PreparedLoader

    torch.set_num_threads(1)
    a = argparse.Namespace(**args_dict)
    status = [_status()]
    ds = PreparedDataset(folder, seq_len=a.seq_len)
    loader = PreparedLoader(ds, global_batch_size=a.batch, micro_batch_size=a.batch, seq_len=a.seq_len, seed=0)
    status.append(_status())
    waits = []
    for _ in range(a.read_steps):
        loader.next_batch()
        waits.append(loader.last_wait_s)
        time.sleep(a.step_ms / 1e3)  # the training step
    loader.close()
    status.append(_status())
    rest = sorted(waits[1:]) or [0.0]
    out_queue.put({"num_tokens": ds.num_tokens, "num_samples": len(ds), "num_shards": len(ds._shards),
                   "rss_mb": {when: s for when, s in zip(("start", "opened", "after_loop"), status)},
                   "first_batch_wait_ms": round(waits[0] * 1e3, 3),
                   "wait_ms_median": round(statistics.median(rest) * 1e3, 3),
                   "wait_ms_p99": round(rest[min(len(rest) - 1, int(0.99 * len(rest)))] * 1e3, 3),
                   "wait_ms_max": round(rest[-1] * 1e3, 3)})


def _status() -> dict:
    """RssAnon / RssFile / VmRSS of this process, MB."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def in_fresh_process(target, *args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out_queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out_queue))
    proc.start()
    while True:
        try:
            result = out_queue.get(timeout=1.0)
            break
        except queue.Empty:
            if proc.exitcode is not None:
                raise SystemExit(f"{target.__name__} failed (exit code {proc.exitcode})") from None
    proc.join()
    return result


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def prepared_tokens_of(folder: Path, doc_ids: list[int]) -> dict[int, list[int]]:
    """The tokens of documents (by their number in the corpus) in a prepared folder's train split."""
    m = json.loads((folder / "manifest.json").read_text())
    out, first = {}, 0
    for shard in m["splits"]["train"]["shards"]:
        n = shard["num_documents"]
        wanted = [d for d in doc_ids if first <= d < first + n]
        if wanted:
            tokens = np.memmap(folder / shard["bin"], dtype=m["dtype"], mode="r")
            starts = np.append(np.load(folder / shard["idx"]), shard["num_tokens"])
            for d in wanted:
                out[d] = tokens[starts[d - first]: starts[d - first + 1]].tolist()
        first += n
    return out


def replicate(folder: Path, dest: Path, times: int) -> Path:
    """A prepared folder listing every shard of `folder` `times` times, as hard links (no bytes copied)."""
    dest.mkdir()
    m = json.loads((folder / "manifest.json").read_text())
    shards = []
    for r in range(times):
        for shard in m["splits"]["train"]["shards"]:
            copy = dict(shard, bin=f"r{r}-{shard['bin']}", idx=f"r{r}-{shard['idx']}")
            os.link(folder / shard["bin"], dest / copy["bin"])
            os.link(folder / shard["idx"], dest / copy["idx"])
            shards.append(copy)
    train = m["splits"]["train"]
    m["splits"] = {"train": {"num_tokens": train["num_tokens"] * times,
                             "num_documents": train["num_documents"] * times, "shards": shards}}
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


def run_prepare(name: str, source: Path, tok: Path, out: Path, workers: int, corpus: dict, shard_mb: float) -> dict:
    argv = ["data", "prepare", str(source), "--tokenizer", str(tok), "--out", str(out), "--workers", str(workers),
            "--shard-mb", str(shard_mb), "--no-progress"]
    src = str(Path(meshlm.__file__).resolve().parents[1])  # the meshlm this benchmark imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", PREPARE, *argv], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"meshlm data prepare failed for {name}: {done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    m = json.loads((out / "manifest.json").read_text())
    tokens = m["splits"]["train"]["num_tokens"]
    return {"input": source.name, "workers": workers, "seconds": round(r["seconds"], 2),
            "text_mb_per_s": round(corpus["text_bytes"] / r["seconds"] / 1e6, 2),
            "tokens_per_s": round(tokens / r["seconds"]), "num_tokens": tokens,
            "cpu_s": round(r["cpu_s"], 2), "text_mb_per_cpu_s": round(corpus["text_bytes"] / r["cpu_s"] / 1e6, 2),
            "num_shards": len(m["splits"]["train"]["shards"]), "max_rss_mb": r["max_rss_mb"],
            "output_bytes": sum((out / s["bin"]).stat().st_size for s in m["splits"]["train"]["shards"])}


def run_hf(parquet: Path, tok: Path, num_proc: int, cache: Path, corpus: dict) -> dict:
    argv = json.dumps([str(parquet), str(tok), num_proc, str(cache), sorted(corpus["kept"])])
    done = subprocess.run([sys.executable, "-c", HF_MAP, argv], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"datasets.map failed with num_proc={num_proc}: {done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(cache, ignore_errors=True)
    total = r["load_s"] + r["map_s"]
    return {"num_proc": num_proc, "load_s": round(r["load_s"], 2), "map_s": round(r["map_s"], 2),
            "map_text_mb_per_s": round(corpus["text_bytes"] / r["map_s"] / 1e6, 2),
            "load_and_map_text_mb_per_s": round(corpus["text_bytes"] / total / 1e6, 2),
            "cpu_s": round(r["cpu_s"], 2), "text_mb_per_cpu_s": round(corpus["text_bytes"] / r["cpu_s"] / 1e6, 2),
            "num_tokens": r["num_tokens"], "max_rss_mb": r["max_rss_mb"], "datasets": r["datasets_version"],
            "_kept_tokens": {int(i): ids for i, ids in r["kept_tokens"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=2048, help="corpus text, MB (default %(default)s)")
    ap.add_argument("--workers", default="1,2", help="meshlm prepare worker counts (default %(default)s)")
    ap.add_argument("--hf-num-procs", default="1,2", help="datasets.map num_proc values (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default %(default)s)")
    ap.add_argument("--shard-mb", type=float, default=64, help="prepare --shard-mb (default %(default)s)")
    ap.add_argument("--check-docs", type=int, default=200, help="documents checked token by token")
    ap.add_argument("--rss-scale", type=int, default=10, help="the larger read-loop corpus, x the prepared one")
    ap.add_argument("--read-steps", type=int, default=300, help="read loop steps (default %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="samples per step (default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default %(default)s)")
    ap.add_argument("--step-ms", type=float, default=20, help="the training step the loop sleeps (default %(default)s)")
    ap.add_argument("--tmp", default=None, help="folder for the corpus and outputs (default: the system's temp)")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args_smoke(ap, dict(size_mb=2, workers="2", hf_num_procs="2", vocab=512, shard_mb=0.5, check_docs=20,
                                     rss_scale=2, read_steps=5, batch=4, seq_len=64, step_ms=1))
    if missing := missing_extras("tokenizers", "pyarrow", "zstandard"):
        if args.smoke:
            print_smoke_skip("data", {"everything": f"needs {', '.join(missing)} (pip install -e \".[data]\")"})
            return
        raise SystemExit(f"benchmarks/data.py needs {', '.join(missing)}: pip install -e \".[data]\"")
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        result = run(Path(tmp), args, workers)
    print(json.dumps(result, indent=2))


def run(tmp: Path, args, workers: list[int]) -> dict:
    load_before = os.getloadavg()
    began = time.perf_counter()
    corpus = write_corpus(tmp, args.size_mb, seed=args.seed, check_docs=args.check_docs)
    generated = time.perf_counter()
    tok = tmp / "tokenizer.json"
    train_tokenizer(tok, corpus["train_docs"], args.vocab)
    from tokenizers import Tokenizer

    direct = Tokenizer.from_file(str(tok))
    eos = direct.token_to_id("<|endoftext|>")
    expected = {i: direct.encode(d, add_special_tokens=False).ids + [eos] for i, d in corpus["kept"].items()}

    prepare_runs, mismatches, outputs = {}, {}, []
    inputs = [("jsonl_zst", tmp / "corpus.jsonl.zst", w) for w in workers] + [("parquet", tmp / "corpus.parquet",
                                                                               max(workers))]
    for kind, source, w in inputs:
        name = f"{kind}_workers_{w}"
        out = tmp / f"out-{name}"
        prepare_runs[name] = run_prepare(name, source, tok, out, w, corpus, args.shard_mb)
        got = prepared_tokens_of(out, sorted(expected))
        mismatches[name] = sum(got.get(i) != ids for i, ids in expected.items())
        outputs.append(out)
    for out in outputs[1:]:  # the first one is read below
        shutil.rmtree(out)

    hf: dict = {}
    if missing := missing_extras("datasets"):
        hf = {"skipped": f"needs {', '.join(missing)} (pip install datasets)"}
    else:
        for n in (int(p) for p in args.hf_num_procs.split(",")):
            row = run_hf(tmp / "corpus.parquet", tok, n, tmp / "hf-cache", corpus)
            kept = row.pop("_kept_tokens")
            mismatches[f"hf_num_proc_{n}"] = sum(kept.get(i) != ids for i, ids in expected.items())
            hf[f"num_proc_{n}"] = row

    reading = vars(args)
    loop = {"seq_len": args.seq_len, "batch": args.batch, "steps": args.read_steps, "step_ms": args.step_ms,
            "prepared": in_fresh_process(_read_loop_process, str(outputs[0]), reading)}
    big = replicate(outputs[0], tmp / "replicated", args.rss_scale)
    loop[f"prepared_x{args.rss_scale}"] = in_fresh_process(_read_loop_process, str(big), reading)

    token_counts = {n: r["num_tokens"] for n, r in prepare_runs.items()} | \
                   {f"hf_{n}": r["num_tokens"] for n, r in hf.items() if isinstance(r, dict)}
    return {"benchmark": "data", "smoke": args.smoke,
            "corpus": {"text_mb": round(corpus["text_bytes"] / 1e6, 2), "documents": corpus["num_docs"],
                       "jsonl_zst_mb": round(corpus["jsonl_zst_bytes"] / 1e6, 2),
                       "parquet_mb": round(corpus["parquet_bytes"] / 1e6, 2),
                       "generate_s": round(generated - began, 1), "tokenizer_vocab": direct.get_vocab_size()},
            "prepare": prepare_runs, "hf_datasets": hf,
            "check": {"documents_checked": len(expected), "mismatched_documents": mismatches,
                      "token_counts_agree": len(set(token_counts.values())) == 1, "token_counts": token_counts},
            "read_loop": loop,
            "machine": {"cpus": os.cpu_count(), "load_avg_1m_before": round(load_before[0], 2),
                        "load_avg_1m_after": round(os.getloadavg()[0], 2),
                        "total_s": round(time.perf_counter() - began, 1)}}


if __name__ == "__main__":
    main()
