"""`meshlm rag index | search`: build or query a retrieval index for `meshlm serve --rag`."""

from __future__ import annotations

import json
import sys

from meshlm.cli.common import require_extra
from meshlm.infer.rag import MODES, RagIndex, build_index


def add_parser(sub) -> None:
    p = sub.add_parser("rag", help="build or query a retrieval index for `meshlm serve --rag`",
                       description="Retrieval-augmented generation: build a passage index (BM25, optionally "
                                   "dense) from documents, or search one.")
    rag_sub = p.add_subparsers(dest="rag_command", metavar="ACTION", required=True)
    ix = rag_sub.add_parser("index", help="chunk and index documents",
                            description="Index a folder of .txt/.md files or a JSONL file ({\"text\", \"id\"?, "
                                        "\"title\"?} per line) into the folder --out. Files that are not text "
                                        "(binary, or not UTF-8) are skipped, named in one line.")
    ix.add_argument("docs", metavar="DOCS", help="folder of .txt/.md files, or a .jsonl file")
    ix.add_argument("--out", required=True, metavar="INDEX", help="index folder to write")
    ix.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    ix.add_argument("--chunk-overlap", type=int, default=32, help="tokens shared by consecutive chunks (default 32)")
    ix.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="count tokens with this model folder's tokenizer.json, or that file (default: whitespace "
                         "words)")
    ix.add_argument("--embed-model", default=None, metavar="DIR",
                    help="also build a dense index with this local Hugging Face encoder folder")
    ix.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    se = rag_sub.add_parser("search", help="print the passages an index finds for a query (JSON)")
    se.add_argument("index", metavar="INDEX")
    se.add_argument("query")
    se.add_argument("--top-k", type=int, default=4, help="passages to return (default 4)")
    se.add_argument("--mode", choices=MODES, default="bm25", help="bm25 (default), dense or hybrid")


def run(args) -> int:
    require_extra("rag", "bm25s")
    if args.rag_command == "index":
        meta = build_index(args.docs, args.out, chunk_tokens=args.chunk_tokens, chunk_overlap=args.chunk_overlap,
                           tokenizer_dir=args.tokenizer, embed_model=args.embed_model, overwrite=args.overwrite,
                           log=lambda line: print(f"meshlm rag index: {line}", file=sys.stderr, flush=True))
        print(f"wrote {args.out}: {meta['num_chunks']} chunks of {meta['chunk_tokens']} tokens from "
              f"{meta['num_documents']} documents (bm25{' + dense' if meta['dense'] else ''})")
        return 0
    if not args.query.strip():
        raise ValueError("the query is empty; pass the words to search for, e.g. meshlm rag search INDEX \"rope scaling\"")
    index = RagIndex.load(args.index)
    hits = index.search(args.query, top_k=args.top_k, mode=args.mode)
    print(json.dumps([{**p.public(), "text": p.text} for p in hits], indent=1, ensure_ascii=False))
    return 0
