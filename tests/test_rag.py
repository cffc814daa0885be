"""Retrieval-augmented generation: `meshlm rag index`, BM25 recall on a generated corpus, the dense path with a
tiny random encoder built here, refusal of corrupt indexes, and `meshlm serve --rag` end to end."""

import json
import random

import pytest

pytest.importorskip("bm25s")
transformers = pytest.importorskip("transformers")

from meshlm.cli import main  # noqa: E402
from meshlm.infer.rag import RagIndex, RagIndexError, build_index, format_passages  # noqa: E402

SYLLABLES = ["ka", "lo", "mi", "ter", "zu", "van", "rop", "eli", "dus", "gar", "fen", "qui", "bra", "tol", "nex"]
PLACES = ["cellar", "tower", "garden", "harbor", "library", "mill", "chapel", "forge"]
COLORS = ["red", "blue", "green", "silver", "black", "white", "golden", "amber"]


def make_corpus(n: int = 200) -> list[dict]:
    """n short documents, each with one unique fact about a made-up name (unique per document)."""
    rng = random.Random(0)
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(SYLLABLES) for _ in range(3))
        if name not in names:
            names.append(name)
    docs = []
    for i, name in enumerate(names):
        fact = f"{name.capitalize()} hides the {rng.choice(COLORS)} key in the {rng.choice(PLACES)} of {rng.choice(names)}."
        filler = " ".join(rng.choice(PLACES + COLORS) for _ in range(12))
        docs.append({"id": f"doc{i:03d}", "title": f"Note {i}", "text": f"{fact} {filler}.", "name": name})
    return docs


def question(doc: dict) -> str:
    return f"Where does {doc['name'].capitalize()} hide the key?"


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("rag")
    docs = make_corpus()
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({k: d[k] for k in ("id", "title", "text")}) + "\n" for d in docs))
    assert main(["rag", "index", str(path), "--out", str(root / "index"), "--chunk-tokens", "12",
                 "--chunk-overlap", "4"]) == 0
    return docs, root / "index"


def test_bm25_recall_and_deterministic_template(corpus_index, capsys):
    docs, index_dir = corpus_index
    index = RagIndex.load(index_dir)
    assert len(index) > len(docs)  # several chunks per document
    hits = sum(any(p.doc_id == d["id"] for p in index.search(question(d), top_k=4)) for d in docs)
    assert hits / len(docs) >= 0.95, hits
    found = index.search(question(docs[7]), top_k=4)
    # The block lists passages in index order, whatever their scores: same passages, same prompt prefix.
    block = format_passages(found)
    assert block == format_passages(list(reversed(found)))
    assert block.startswith("Use the following passages to answer.\n\n[1] ")
    assert main(["rag", "search", str(index_dir), question(docs[7]), "--top-k", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed[0]["doc_id"] == "doc007" and "text" in printed[0]


def test_folder_of_documents_and_chunking(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from meshlm.infer.rag import chunk_document, read_documents

    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("# Alpha title\nalpha beta gamma delta epsilon")
    (tmp_path / "docs" / "sub" / "b.txt").write_text("one two three")
    (tmp_path / "docs" / "skip.bin").write_text("not a document")
    docs = read_documents(tmp_path / "docs")
    assert [(d["id"], d["title"]) for d in docs] == [("a.md", "Alpha title"), ("sub/b.txt", "b")]
    words = "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9"
    assert chunk_document(words, chunk_tokens=4, overlap=1) == ["w0 w1 w2 w3", "w3 w4 w5 w6", "w6 w7 w8 w9"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)} | {"[UNK]": 10}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert chunk_document(words, chunk_tokens=5, overlap=0, tokenizer=tok) == ["w0 w1 w2 w3 w4", "w5 w6 w7 w8 w9"]
    with pytest.raises(ValueError, match="chunk-overlap"):
        build_index(tmp_path / "docs", tmp_path / "ix", chunk_tokens=4, chunk_overlap=4)


def test_a_long_line_without_breaks_is_cut_by_length(tmp_path):
    """One line of 400k characters (a minified or encoded file) is many chunks of `--chunk-tokens` tokens, a
    token being at most MAX_TOKEN_CHARS characters: not one chunk far past any prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from meshlm.infer.rag import MAX_TOKEN_CHARS, chunk_document

    rng = random.Random(0)
    line = "".join(rng.choice("abcdef0123456789") for _ in range(400_000))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "blob.txt").write_text(line + "\n")
    (tmp_path / "docs" / "prose.md").write_text("# Prose\n" + " ".join(f"w{i}" for i in range(100)))
    assert main(["rag", "index", str(tmp_path / "docs"), "--out", str(tmp_path / "ix"), "--chunk-tokens", "64",
                 "--chunk-overlap", "0"]) == 0
    chunks = [json.loads(x) for x in (tmp_path / "ix" / "chunks.jsonl").read_text().splitlines()]
    blob = [c["text"] for c in chunks if c["doc_id"] == "blob.txt"]
    assert len(blob) == -(-len(line) // (64 * MAX_TOKEN_CHARS)) and "".join(blob) == line
    assert max(len(c) for c in blob) == 64 * MAX_TOKEN_CHARS
    prose = [c["text"].split() for c in chunks if c["doc_id"] == "prose.md"]  # words, as before
    assert prose == [["#", "Prose"] + [f"w{i}" for i in range(62)], [f"w{i}" for i in range(62, 100)]]
    # A tokenizer's one unknown token over a whole line is cut too: after a word where it has spaces.
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    pieces = chunk_document(line[:10_000], chunk_tokens=8, overlap=2, tokenizer=tok)
    assert len(pieces) > 50 and max(map(len, pieces)) == 8 * MAX_TOKEN_CHARS
    tok.pre_tokenizer = None
    prose = "the quick brown fox jumps over the lazy dog " * 200
    pieces = chunk_document(prose, chunk_tokens=4, overlap=1, tokenizer=tok)
    assert len(pieces) > 50 and max(map(len, pieces)) <= 4 * MAX_TOKEN_CHARS
    assert all(set(p.split()) <= set(prose.split()) for p in pieces), pieces[:3]


def test_files_that_are_not_text_are_skipped_in_one_line(tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "good.txt").write_text("the amber key hides in the mill")
    (docs / "nul.txt").write_bytes(b"looks like text\0\0\x01\x02 but is not")
    (docs / "latin1.md").write_bytes("# Caf\u00e9\nna\u00efve".encode("latin-1"))
    (docs / "sub" / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (docs / "utf8.md").write_text("# Caf\u00e9\nna\u00efve text", encoding="utf-8")
    assert main(["rag", "index", str(docs), "--out", str(tmp_path / "ix")]) == 0
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1, err
    assert "skipped 3 of the 5" in err and all(name in err for name in ("nul.txt", "latin1.md", "sub/image.txt"))
    assert "from 2 documents" in out
    chunks = [json.loads(x) for x in (tmp_path / "ix" / "chunks.jsonl").read_text().splitlines()]
    assert sorted(c["doc_id"] for c in chunks) == ["good.txt", "utf8.md"] and chunks[1]["title"] == "Caf\u00e9"
    for name in ("good.txt", "utf8.md"):
        (docs / name).unlink()
    assert main(["rag", "index", str(docs), "--out", str(tmp_path / "ix2")]) == 2  # nothing left to index
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no text document" in err[0] and "sub/image.txt" in err[0], err


def test_corrupt_or_mismatched_index_is_refused(corpus_index, tmp_path, capsys):
    import shutil

    _, index_dir = corpus_index
    broken = tmp_path / "broken"
    shutil.copytree(index_dir, broken)
    with open(broken / "chunks.jsonl", "r+b") as f:
        f.seek(40)
        f.write(b"#")
    with pytest.raises(RagIndexError, match="chunks.jsonl does not match its checksum"):
        RagIndex.load(broken)
    assert main(["rag", "search", str(broken), "anything"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meshlm rag index" in err
    shutil.rmtree(broken)
    shutil.copytree(index_dir, broken)
    meta = json.loads((broken / "meta.json").read_text())
    (broken / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(RagIndexError, match="version 99"):
        RagIndex.load(broken)
    (broken / "meta.json").write_text(json.dumps(meta))
    (broken / "bm25" / "vocab.index.json").unlink()
    with pytest.raises(RagIndexError, match="missing"):
        RagIndex.load(broken)
    with pytest.raises(RagIndexError, match="no meta.json"):
        RagIndex.load(tmp_path)


def _tiny_encoder(path, words: list[str], seed: int):
    import torch

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words))
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(cfg).save_pretrained(path)
    return path


def test_dense_index_with_a_local_encoder(tmp_path):
    docs = make_corpus(40)
    words = sorted({w for d in docs for w in (d["title"] + " " + d["text"]).lower().replace(".", " ").split()})
    encoder = _tiny_encoder(tmp_path / "enc", words, seed=0)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": d["id"], "title": d["title"], "text": d["text"]}) + "\n" for d in docs))
    meta = build_index(src, tmp_path / "ix", chunk_tokens=64, chunk_overlap=0, embed_model=encoder)
    assert meta["dense"]["dim"] == 32 and meta["num_chunks"] == 40
    index = RagIndex.load(tmp_path / "ix")
    assert index.modes == ("bm25", "dense", "hybrid")
    for d in docs[:10]:  # a random encoder still maps a chunk's own text nearest to itself
        chunk = index.chunks[int(d["id"][3:])]
        top = index.search(chunk["title"] + "\n" + chunk["text"], top_k=3, mode="dense")
        assert top[0].doc_id == d["id"] and top[0].score == pytest.approx(1.0, abs=1e-4)
    assert index.search(question(docs[3]), top_k=4, mode="hybrid")[0].doc_id == docs[3]["id"]
    if index._faiss is not None:  # faiss and the numpy fallback rank alike
        with_faiss = [(p.id, round(p.score, 4)) for p in index.search(question(docs[9]), top_k=5, mode="dense")]
        index._faiss = None
        assert [(p.id, round(p.score, 4)) for p in index.search(question(docs[9]), top_k=5, mode="dense")] == with_faiss
    other = _tiny_encoder(tmp_path / "other", words, seed=1)
    with pytest.raises(RagIndexError, match="not the one"):
        RagIndex.load(tmp_path / "ix", embed_model=other)
    index.embeddings = None  # as an index built without --embed-model
    with pytest.raises(ValueError, match="dense"):
        index.search("x", mode="dense")


@pytest.fixture(scope="module")
def rag_server(corpus_index, tmp_path_factory):
    from test_server import make_model_dir, running, serve_args

    from meshlm.processes import free_port

    from meshlm.cli.serve import build_server

    pytest.importorskip("fastapi")
    model_dir = make_model_dir(tmp_path_factory.mktemp("rag-llama"), max_len=1024)
    port = free_port()
    srv, engine = build_server(serve_args(model_dir, port, "--max-num-batched-tokens", "256",
                                          "--rag", str(corpus_index[1])))
    with running(srv, engine):
        yield f"http://127.0.0.1:{port}", model_dir


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_served_rag_end_to_end(rag_server, corpus_index):
    import httpx

    url, model_dir = rag_server
    docs, index_dir = corpus_index
    doc = docs[42]
    body = {"model": "tiny", "prompt": question(doc), "max_tokens": 4, "temperature": 0, "rag": {"top_k": 4}}
    before = httpx.get(url + "/metrics").text
    first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert doc["id"] in [p["doc_id"] for p in first["retrieved"]], first
    assert set(first["retrieved"][0]) == {"id", "doc_id", "title", "score"}
    assert first["choices"][0]["retrieved"] == first["retrieved"]
    for _ in range(2):  # the same question again: its passages are already in the prefix cache
        again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    metrics = httpx.get(url + "/metrics").text
    assert _metric(metrics, "meshlm_rag_prefix_cache_hit_tokens_total") > _metric(
        before, "meshlm_rag_prefix_cache_hit_tokens_total")
    assert _metric(metrics, "meshlm_rag_prefix_cache_hit_rate") > 0.3
    assert _metric(metrics, "meshlm_rag_retrieval_seconds_count") == 3
    assert _metric(metrics, "meshlm_rag_retrieved_tokens_sum") > 0
    # Chat, streamed: the first chunk carries the passages.
    chat = {"model": "tiny", "messages": [{"role": "user", "content": question(docs[5])}], "max_tokens": 2,
            "stream": True, "rag": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=60) as r:
        first_event = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert docs[5]["id"] in [p["doc_id"] for p in first_event["choices"][0]["retrieved"]]
    for bad in ({"rag": {"top_k": 0}}, {"rag": {"mode": "dense"}}, {"rag": {"k": 3}}, {"rag": "yes"},
                {"prompt": [5, 6, 7]}):
        r = httpx.post(url + "/v1/completions", json={**body, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("rag", "prompt"), (bad, r.text)
    # Offline: the same passages and the same greedy text.
    from meshlm import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", block_size=8, num_blocks=256)
    out = llm.generate(question(doc), SamplingParams(temperature=0, max_tokens=4), rag=index_dir)[0]
    assert out.retrieved == first["retrieved"] and out.text == first["choices"][0]["text"]
