"""What the prepared-data tests share: a tiny BPE tokenizer trained here, synthetic documents, a corpus
written in every input format, and reading a prepared split back as (tokens, document starts)."""

import gzip
import json
import random
from pathlib import Path

import numpy as np

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "θήτα", "kappa", "lambda", "mu", "naïve",
         "def", "return", "(x)", "\n", "  ", "日本", "🙂", "0", "42"]


def make_docs(n: int, seed: int = 0) -> list[str]:
    """`n` documents of 0 to 60 words, Unicode and whitespace included (one is empty)."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]
    docs[n // 2] = ""
    return docs


def make_tokenizer(path: Path, *, eos: bool = True) -> Path:
    """A byte-level BPE of 400 entries trained on `make_docs` (milliseconds), with "</s>" when `eos`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "</s>"] if eos else ["<unk>"]
    tok.train_from_iterator(make_docs(200, seed=99), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def encode(tokenizer_path: Path, docs: list[str]) -> list[list[int]]:
    """Each document tokenized directly, EOS appended when the tokenizer has "</s>"."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("</s>")
    return [tok.encode(d, add_special_tokens=False).ids + ([eos] if eos is not None else []) for d in docs]


def write_jsonl(path: Path, docs: list[str], *, field: str = "text") -> Path:
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    if path.name.endswith(".gz"):
        lines = gzip.compress(lines)
    elif path.name.endswith(".zst"):
        import zstandard

        lines = zstandard.ZstdCompressor().compress(lines)
    path.write_bytes(lines)
    return path


def write_parquet(path: Path, docs: list[str], *, field: str = "text", row_group_size: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size)
    return path


def write_all_formats(folder: Path, docs: list[str]) -> list[str]:
    """`docs` spread over a folder of every input format; returns them in the order `prepare` reads them."""
    folder.mkdir(parents=True)
    parts = [docs[i::6] for i in range(6)]
    write_jsonl(folder / "a.jsonl", parts[0])
    write_jsonl(folder / "b.jsonl.gz", parts[1])
    write_jsonl(folder / "c.jsonl.zst", parts[2])
    write_parquet(folder / "d.parquet", parts[3])
    texts = [d for d in parts[4] + parts[5] if d]  # a text file is one document; empty files are refused
    (folder / "sub").mkdir()
    for i, text in enumerate(texts):
        path = folder / "sub" / f"{i:03d}.txt" if i % 2 == 0 else folder / f"e{i:03d}.md"
        path.write_text(text, encoding="utf-8")
    (folder / "_SUCCESS").write_text("")  # skipped, as Spark's markers are
    in_order = sorted((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*") if p.is_file())
    expected = []
    for rel, p in in_order:
        if rel.startswith("_"):
            continue
        text = [p.read_text(encoding="utf-8")] if rel.endswith((".txt", ".md")) else []
        expected += {"a.jsonl": parts[0], "b.jsonl.gz": parts[1], "c.jsonl.zst": parts[2],
                     "d.parquet": parts[3]}.get(rel, text)
    return expected


def read_split(folder: Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """All tokens of a split, shard after shard, and each document's start in that stream."""
    m = json.loads((folder / "manifest.json").read_text())
    tokens, starts, offset = [], [], 0
    for shard in m["splits"][split]["shards"]:
        t = np.fromfile(folder / shard["bin"], dtype=np.dtype(m["dtype"]).newbyteorder("<")).astype(np.int64)
        starts.append(np.load(folder / shard["idx"]) + offset)
        tokens.append(t)
        offset += len(t)
    return np.concatenate(tokens), np.concatenate(starts)
