"""Retrieval-augmented generation: build a passage index from documents, search it, and put the passages
found before a prompt.

Responsible for: reading documents (a folder of .txt/.md files, those that are not text skipped, or a JSONL
file of {"text", "id"?, "title"?}); cutting them into chunks of `chunk_tokens` tokens overlapping by
`chunk_overlap` (tokens of a model's tokenizer.json when given, else whitespace-separated words; a token longer
than MAX_TOKEN_CHARS counts as pieces, so that a line without breaks is cut too); a lexical BM25 index (the `bm25s`
package, extra `rag`) and optionally a dense one over embeddings from a local Hugging Face encoder folder
(mean-pooled, L2-normalised; searched with `faiss-cpu` when installed, else numpy: the same exact inner
product either way); saving and loading the index as plain files (JSON, JSONL, .npy; no pickle) with a
checksum per file, so a corrupt or mismatched index is refused with one line; the prompt template.
Not responsible for: serving (server.py wires retrieval in, off the engine loop), downloading models, or
re-ranking with a cross-encoder.

The template (`RAG_TEMPLATE`), passages in index order (the order they have in the documents, not by
score) so that the same passages always give the same prompt prefix and hit the prefix cache:

    Use the following passages to answer.

    [1] {title}
    {text}

    [2] {title}
    {text}

    {the user's prompt}

For chat requests the passage block (everything before the user's prompt) is a system message put first,
or joined to the front of the request's own first system message.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.files import looks_binary, sha256_file
from meshlm.values import is_integer

FORMAT = "meshlm-rag-index"
VERSION = 1
RAG_HEADER = "Use the following passages to answer.\n\n"
RAG_PASSAGE = "[{n}] {title}\n{text}\n\n"
RAG_TEMPLATE = RAG_HEADER + RAG_PASSAGE + "{prompt}"  # one passage shown; each further one repeats RAG_PASSAGE
MODES = ("bm25", "dense", "hybrid")

# A small English stop list: BM25 down-weights common words anyway, dropping these keeps the index small.
_STOPWORDS = frozenset("a an and are as at be by for from has have he her his i in is it its of on or that the "
                       "their them they this to was were what when where which who why will with you your".split())
_WORD = re.compile(r"\w+", re.UNICODE)
# The chunker's tokens are at most this many characters: a longer one is cut into pieces, each counted as a token,
# so that a chunk of `chunk_tokens` tokens stays short whatever the text (one line of megabytes without spaces).
MAX_TOKEN_CHARS = 16
_UP_TO_LAST_WORD = re.compile(r".*\S(?=\s)", re.DOTALL)
_SPACES = re.compile(r"\s*")


class RagIndexError(ValueError):
    """An index that is missing, corrupt or does not match what it is used with."""


def lexical_tokens(text: str) -> list[str]:
    """Words for BM25: lower-cased runs of letters/digits, stop words dropped."""
    return [w for w in _WORD.findall(text.lower()) if w not in _STOPWORDS]


@dataclass
class Passage:
    id: str  # "<doc id>#<chunk number in the doc>"
    doc_id: str
    title: str
    text: str
    position: int  # row in the index (documents' order)
    score: float = 0.0

    def public(self) -> dict:
        return {"id": self.id, "doc_id": self.doc_id, "title": self.title, "score": round(float(self.score), 6)}


def format_passages(passages: list[Passage]) -> str:
    """The passage block that goes before the prompt (empty when nothing was found)."""
    if not passages:
        return ""
    ordered = sorted(passages, key=lambda p: p.position)
    return RAG_HEADER + "".join(RAG_PASSAGE.format(n=i + 1, title=p.title, text=p.text)
                                for i, p in enumerate(ordered))


def augment_messages(messages: list[dict], block: str) -> list[dict]:
    """Chat messages with the passage block first (a system message)."""
    if not block:
        return messages
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": block + messages[0]["content"]}] + messages[1:]
    return [{"role": "system", "content": block.rstrip("\n")}] + messages


# ---------------------------------------------------------------------------------------------
# Reading documents and chunking
# ---------------------------------------------------------------------------------------------


def read_documents(path: str | Path, *, log=None) -> list[dict]:
    """[{"id", "title", "text"}] from a folder of .txt/.md files (sorted, recursive) or a .jsonl file.

    Files of a folder that are not text (a NUL byte in their first 8 KiB, or not UTF-8) are skipped:
    `log(line)`, when given, gets one line naming them."""
    path = Path(path)
    docs = []
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in (".txt", ".md") and p.is_file())
        if not files:
            raise ValueError(f"{path} holds no .txt or .md file; give a folder of documents or a .jsonl file")
        skipped = []
        for f in files:
            text = _text_of(f)
            if text is None:
                skipped.append(f.relative_to(path).as_posix())
                continue
            heading = re.search(r"^#\s+(.+)$", text, re.MULTILINE) if f.suffix.lower() == ".md" else None
            docs.append({"id": f.relative_to(path).as_posix(), "title": heading.group(1).strip() if heading else f.stem,
                         "text": text})
        note = (f"{len(skipped)} of the {len(files)} .txt/.md files, not text (binary or not UTF-8): "
                f"{', '.join(skipped)}")
        if not docs:
            raise ValueError(f"{path} holds no text document: {note}")
        if skipped and log is not None:
            log(f"skipped {note}")
    elif path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n} is not JSON ({e}); each line must be an object with \"text\"") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{n} needs \"text\" as a string (and optionally \"id\", \"title\")")
            doc_id = str(row.get("id", f"line-{n}"))
            docs.append({"id": doc_id, "title": str(row.get("title") or doc_id), "text": row["text"]})
        if not docs:
            raise ValueError(f"{path} holds no document")
    else:
        raise ValueError(f"documents {str(path)!r}: give a folder of .txt/.md files or a .jsonl file")
    seen = set()
    for d in docs:
        if d["id"] in seen:
            raise ValueError(f"document id {d['id']!r} appears twice; ids must be unique")
        seen.add(d["id"])
    return docs


def _text_of(file: Path) -> str | None:
    """A document file's text, or None when it is not text: a NUL byte in its first 8 KiB, or not UTF-8."""
    data = file.read_bytes()
    if looks_binary(data):
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _spans(text: str, tokenizer) -> list[tuple[int, int]]:
    """Character span of each token: the tokenizer's (a `tokenizers.Tokenizer`), or whitespace words; a
    token longer than MAX_TOKEN_CHARS (a line without spaces, a tokenizer's unknown run) counts as pieces."""
    if tokenizer is None:
        spans = [m.span() for m in re.finditer(r"\S+", text)]
    else:
        spans = [span for span in tokenizer.encode(text, add_special_tokens=False).offsets if span[1] > span[0]]
    if all(end - start <= MAX_TOKEN_CHARS for start, end in spans):
        return spans
    return [piece for start, end in spans for piece in _pieces(text, start, end)]


def _pieces(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """text[start:end] as spans of at most MAX_TOKEN_CHARS characters, each cut after its last word where it
    has whitespace, else at the limit."""
    pieces = []
    while end - start > MAX_TOKEN_CHARS:
        words = _UP_TO_LAST_WORD.match(text, start, start + MAX_TOKEN_CHARS)
        cut = words.end() if words else start + MAX_TOKEN_CHARS
        pieces.append((start, cut))
        start = _SPACES.match(text, cut, end).end()
    if start < end:
        pieces.append((start, end))
    return pieces


def chunk_document(text: str, *, chunk_tokens: int, overlap: int, tokenizer=None) -> list[str]:
    """Consecutive windows of `chunk_tokens` tokens, each starting `chunk_tokens - overlap` after the last
    (a token being at most MAX_TOKEN_CHARS characters)."""
    spans = _spans(text, tokenizer)
    chunks = []
    for start in range(0, max(len(spans), 1), chunk_tokens - overlap):
        window = spans[start:start + chunk_tokens]
        if not window:
            break
        chunks.append(text[window[0][0]:window[-1][1]])
        if start + chunk_tokens >= len(spans):
            break
    return chunks


# ---------------------------------------------------------------------------------------------
# Dense embeddings
# ---------------------------------------------------------------------------------------------


class Embedder:
    """Mean-pooled, L2-normalised sentence embeddings from a local Hugging Face encoder folder."""

    def __init__(self, path: str | Path, *, batch_size: int = 32, max_length: int = 256):
        import transformers

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"--embed-model {str(path)!r} is not a Hugging Face model folder (no config.json); "
                             "give a local encoder folder (nothing is downloaded)")
        self.path = path
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.batch_size, self.max_length = batch_size, max_length

    def fingerprint(self) -> str:
        """What the stored vectors depend on: the model's config and weights files."""
        h = hashlib.sha256()
        for f in sorted(self.path.iterdir()):
            if f.suffix in (".json", ".safetensors", ".txt", ".model"):
                h.update(f.name.encode())
                h.update(sha256_file(f).encode())
        return h.hexdigest()

    def __call__(self, texts: list[str]) -> np.ndarray:
        import torch

        out = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"][..., None].to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
                out.append(torch.nn.functional.normalize(pooled.float(), dim=-1).numpy())
        dim = self.model.config.hidden_size
        return np.concatenate(out) if out else np.zeros((0, dim), dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------------------------


def _bm25s():
    try:
        import bm25s
    except ImportError:
        raise ValueError("RAG needs the bm25s package: pip install bm25s (the rag extra: pip install -e "
                         "\".[rag]\")") from None
    return bm25s


def _bm25(tokens: list[list[str]]):
    bm25s = _bm25s()
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    return retriever


def build_index(docs_path: str | Path, out: str | Path, *, chunk_tokens: int = 256, chunk_overlap: int = 32,
                tokenizer_dir: str | Path | None = None, embed_model: str | Path | None = None,
                overwrite: bool = False, log=None) -> dict:
    """Chunk the documents, index them, write the index folder; returns its meta.json content. `log(line)`,
    when given, hears of document files skipped as not text."""
    if chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens={chunk_tokens} must be >= 1")
    if not 0 <= chunk_overlap < chunk_tokens:
        raise ValueError(f"--chunk-overlap={chunk_overlap} must be >= 0 and below --chunk-tokens={chunk_tokens}")
    out = Path(out)
    docs_dir = Path(docs_path)
    if docs_dir.is_dir() and (out.resolve() == docs_dir.resolve() or docs_dir.resolve() in out.resolve().parents):
        raise ValueError(f"--out {out} lies inside the documents folder {docs_path}; a rebuild would index the "
                         "index: pass an --out outside it")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; give an empty or new folder, or --overwrite")
    tokenizer, tokenizer_name = None, "words"
    if tokenizer_dir is not None:
        from meshlm.tokenizer import read_tokenizer_json

        tok_file = Path(tokenizer_dir)
        tok_file = tok_file if tok_file.is_file() else tok_file / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"--tokenizer {str(tokenizer_dir)!r} has no tokenizer.json; give a model folder or "
                             "its tokenizer.json")
        tokenizer, tokenizer_name = read_tokenizer_json(tok_file), f"tokenizer.json sha256:{sha256_file(tok_file)}"
    docs = read_documents(docs_path, log=log)
    chunks = []
    for d in docs:
        for i, text in enumerate(chunk_document(d["text"], chunk_tokens=chunk_tokens, overlap=chunk_overlap,
                                                tokenizer=tokenizer)):
            chunks.append({"id": f"{d['id']}#{i}", "doc_id": d["id"], "title": d["title"], "text": text})
    if not chunks:
        raise ValueError(f"the documents in {docs_path} hold no text to index")
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("meta.json", "chunks.jsonl", "embeddings.npy"):
        (out / stale).unlink(missing_ok=True)
    with open(out / "chunks.jsonl", "w", encoding="utf-8") as f:
        for c in chunks:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    retriever = _bm25([lexical_tokens(c["title"] + " " + c["text"]) for c in chunks])
    retriever.save(str(out / "bm25"), show_progress=False)
    dense = None
    if embed_model is not None:
        embedder = Embedder(embed_model)
        vectors = embedder([c["title"] + "\n" + c["text"] for c in chunks]).astype(np.float32)
        np.save(out / "embeddings.npy", vectors, allow_pickle=False)
        dense = {"model": str(Path(embed_model).resolve()), "model_fingerprint": embedder.fingerprint(),
                 "dim": int(vectors.shape[1]), "pooling": "mean", "normalized": True}
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "meta.json")
    meta = {"format": FORMAT, "version": VERSION, "num_documents": len(docs), "num_chunks": len(chunks),
            "chunk_tokens": chunk_tokens, "chunk_overlap": chunk_overlap, "tokenizer": tokenizer_name,
            "dense": dense, "files": {p.relative_to(out).as_posix(): sha256_file(p) for p in files}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


class RagIndex:
    """A loaded index: `search(query, top_k=, mode=)` -> passages, best first."""

    def __init__(self, path: Path, meta: dict, chunks: list[dict], bm25, embeddings: np.ndarray | None,
                 embedder: Embedder | None):
        self.path, self.meta, self.chunks = path, meta, chunks
        self.bm25, self.embeddings, self.embedder = bm25, embeddings, embedder
        self._faiss = None
        if embeddings is not None:
            try:
                import faiss  # exact inner product, as numpy computes it; faster on large indexes
            except ImportError:
                faiss = None
            if faiss is not None:
                self._faiss = faiss.IndexFlatIP(embeddings.shape[1])
                self._faiss.add(embeddings)

    @classmethod
    def load(cls, path: str | Path, *, embed_model: str | Path | None = None, verify: bool = True) -> "RagIndex":
        """Load an index folder; RagIndexError (one line) if it is missing, corrupt or mismatched.

        `embed_model` overrides the encoder folder recorded at build time (it must be the same model:
        its fingerprint is checked). Without a dense part, `embed_model` is refused.
        """
        path = Path(path)
        fix = f"rebuild it with `meshlm rag index DOCS --out {path}`"
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (FileNotFoundError, NotADirectoryError):
            raise RagIndexError(f"{path} is not a meshlm RAG index (no meta.json); build one with "
                                f"`meshlm rag index DOCS --out {path}`") from None
        except ValueError as e:
            raise RagIndexError(f"{path}/meta.json is corrupt ({e}); {fix}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
            raise RagIndexError(f"{path}/meta.json is not a meshlm RAG index description; {fix}")
        if meta.get("version") != VERSION:
            raise RagIndexError(f"{path} is index format version {meta.get('version')!r}; this meshlm reads "
                                f"version {VERSION}; {fix}")
        if verify:
            for name, digest in meta["files"].items():
                f = path / name
                if not f.is_file():
                    raise RagIndexError(f"{path} is incomplete: {name} is missing; {fix}")
                if sha256_file(f) != digest:
                    raise RagIndexError(f"{path} is corrupt: {name} does not match its checksum; {fix}")
        try:
            chunks = [json.loads(line) for line in (path / "chunks.jsonl").read_text(encoding="utf-8").splitlines()]
        except (OSError, ValueError) as e:
            raise RagIndexError(f"{path}/chunks.jsonl cannot be read ({e}); {fix}") from None
        if len(chunks) != meta.get("num_chunks"):
            raise RagIndexError(f"{path} holds {len(chunks)} chunks but meta.json says {meta.get('num_chunks')}; {fix}")
        bm25s = _bm25s()
        try:
            bm25 = bm25s.BM25.load(str(path / "bm25"), allow_pickle=False, show_progress=False)
        except Exception as e:  # noqa: BLE001 -- whatever bm25s raises on broken files: one line
            raise RagIndexError(f"{path}/bm25 cannot be loaded ({type(e).__name__}: {e}); {fix}") from None
        if int(bm25.scores["num_docs"]) != len(chunks):
            raise RagIndexError(f"{path}: the BM25 index has {bm25.scores['num_docs']} chunks, chunks.jsonl "
                                f"{len(chunks)}; {fix}")
        embeddings = embedder = None
        dense = meta.get("dense")
        if dense:
            embeddings = np.load(path / "embeddings.npy", allow_pickle=False)
            if embeddings.shape != (len(chunks), dense["dim"]) or embeddings.dtype != np.float32:
                raise RagIndexError(f"{path}/embeddings.npy has shape {embeddings.shape} ({embeddings.dtype}), "
                                    f"expected ({len(chunks)}, {dense['dim']}) float32; {fix}")
            model_dir = Path(embed_model or dense["model"])
            if not (model_dir / "config.json").is_file():
                raise RagIndexError(f"the index's embedding model {str(model_dir)!r} is not there; give it "
                                    "(the same model the index was built with)")
            embedder = Embedder(model_dir)
            if embedder.fingerprint() != dense["model_fingerprint"]:
                raise RagIndexError(f"embedding model {str(model_dir)!r} is not the one {path} was built with; "
                                    f"give that model, or {fix} --embed-model {model_dir}")
        elif embed_model is not None:
            raise RagIndexError(f"{path} has no dense part; build it with --embed-model to search by embeddings")
        return cls(path, meta, chunks, bm25, embeddings, embedder)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.embeddings is not None else ("bm25",)

    def _passage(self, row: int, score: float) -> Passage:
        c = self.chunks[row]
        return Passage(id=c["id"], doc_id=c["doc_id"], title=c["title"], text=c["text"], position=row, score=score)

    @staticmethod
    def _top(scores: np.ndarray, k: int, *, positive: bool) -> list[tuple[int, float]]:
        """Best k rows, ties broken by row (deterministic whatever the backend)."""
        candidates = np.flatnonzero(scores > 0) if positive else np.arange(len(scores))
        if len(candidates) > k:
            import torch  # its topk stays fast when most scores tie, where np.partition degrades badly

            kth = float(torch.from_numpy(np.ascontiguousarray(scores[candidates], dtype=np.float32)).topk(k).values[-1])
            # Rows tied at the k-th score can be most of the index (a word every chunk has): keep the
            # first ones (candidates are in row order) without sorting them all.
            cand_scores = scores[candidates].astype(np.float32)
            above = candidates[cand_scores > kth]
            tied = candidates[cand_scores == kth][:k - len(above)]
            candidates = np.concatenate([above, tied])
        order = sorted(candidates.tolist(), key=lambda r: (-float(scores[r]), r))[:k]
        return [(r, float(scores[r])) for r in order]

    def _bm25_top(self, query: str, k: int) -> list[tuple[int, float]]:
        words = [w for w in lexical_tokens(query) if w in self.bm25.vocab_dict]
        if not words:
            return []
        return self._top(np.asarray(self.bm25.get_scores(words), dtype=np.float32), k, positive=True)

    def _dense_top(self, query: str, k: int) -> list[tuple[int, float]]:
        q = self.embedder([query]).astype(np.float32)
        if self._faiss is not None:
            # Over-fetch so that ties at the k-th score are broken by row, as numpy's path does.
            scores, rows = self._faiss.search(q, min(len(self.chunks), k + 16))
            found = {int(r): float(s) for r, s in zip(rows[0], scores[0]) if r >= 0}
            return sorted(found.items(), key=lambda x: (-x[1], x[0]))[:k]
        return self._top(self.embeddings @ q[0], k, positive=False)

    def search(self, query: str, *, top_k: int = 4, mode: str = "bm25") -> list[Passage]:
        """The `top_k` passages for `query`, best first. mode: bm25, dense, or hybrid (reciprocal rank fusion)."""
        if mode not in self.modes:
            raise ValueError(f"rag mode {mode!r} is not available for this index; use one of {list(self.modes)}"
                             + ("" if self.embeddings is not None else " (build with --embed-model for dense)"))
        if not is_integer(top_k) or not 1 <= top_k <= 64:
            raise ValueError(f"rag top_k={top_k!r} must be an integer between 1 and 64")
        if mode == "bm25":
            hits = self._bm25_top(query, top_k)
        elif mode == "dense":
            hits = self._dense_top(query, top_k)
        else:  # each list votes 1 / (60 + rank): robust to the two scores' different scales
            fused: dict[int, float] = {}
            for ranked in (self._bm25_top(query, top_k * 4), self._dense_top(query, top_k * 4)):
                for rank, (row, _) in enumerate(ranked):
                    fused[row] = fused.get(row, 0.0) + 1.0 / (60 + rank + 1)
            hits = sorted(fused.items(), key=lambda x: (-x[1], x[0]))[:top_k]
        return [self._passage(row, score) for row, score in hits]


def as_index(index) -> RagIndex:
    return index if isinstance(index, RagIndex) else RagIndex.load(index)
