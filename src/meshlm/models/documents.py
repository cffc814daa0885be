"""Document masking of packed samples: the one representation of where documents lie, and what follows from it.

A packed sample holds several documents back to back. With `data.document_mask` a token attends only to
earlier tokens of its own document (block-causal) and RoPE counts its position from its document's start.
Everything the stack needs is derived from one tensor:

    documents  int64 [batch, seq]: each token's document, numbered within its sample from 0 (the first token's
               document, often the tail of one begun in an earlier sample) and +1 at every document start,
               so non-decreasing along the sequence.

It always covers the whole sequence of `seq` tokens, whatever the layout: a context-parallel rank holding two
chunks of the sequence still gets the whole sequence's documents (every rank has the whole micro-batch; no
communication is needed to know the documents of the K/V chunks it meets).

Responsible for: `documents_from_starts` (what a data loader produces: per sample, where documents begin),
`document_positions` (RoPE's position of each token within its document) and `attention_mask` (which keys a
query may see). Not responsible for: finding document boundaries in text (`tokenizer.encode_with_starts`,
the packing in `meshlm.data.text`), or attention itself (`transformer.Attention.core` and the context-parallel
variants in `meshlm.parallel.context`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def documents_from_starts(starts: Sequence[Sequence[int] | np.ndarray | torch.Tensor], seq_len: int) -> torch.Tensor:
    """Per sample, the offsets within it where a document begins -> `documents` int64 [len(starts), seq_len].

    Offsets outside [0, seq_len) are ignored (a loader may report a start at seq_len: the target of the last
    input token opens a document); repeated offsets (empty documents) count once."""
    flags = torch.zeros(len(starts), seq_len, dtype=torch.bool)
    for row, offsets in enumerate(starts):
        offsets = torch.as_tensor(np.asarray(offsets, dtype=np.int64))
        flags[row, offsets[(offsets >= 0) & (offsets < seq_len)]] = True
    flags = flags.to(torch.int64)
    return flags.cumsum(-1) - flags[:, :1]


def document_positions(documents: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's position within its document, int64 [batch, seq] (RoPE's positions under document masking).

    `positions`: the indices in the sequence of the tokens wanted, [n] or [batch, n] (context parallelism: the
    true positions of a rank's chunks); None: every token."""
    if documents.dim() != 2:
        raise ValueError(f"documents must be [batch, seq] document ids, got shape {list(documents.shape)}")
    index = torch.arange(documents.shape[1], device=documents.device)
    begins = torch.ones_like(documents, dtype=torch.bool)
    begins[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(begins, index, 0).cummax(dim=1).values  # where each token's document begins
    within = index - first
    if positions is None:
        return within
    positions = positions.to(documents.device)
    return within[:, positions] if positions.dim() == 1 else within.gather(1, positions)


def attention_mask(q_documents: torch.Tensor, k_documents: torch.Tensor | None = None, *,
                   causal: bool = True) -> torch.Tensor:
    """bool [batch, queries, keys]: True where a query may attend to a key -- the same document and, with
    `causal`, a key not after the query (queries and keys aligned at their first token; `causal=False` for
    keys that all come before the queries, as a context-parallel rank's earlier chunks do)."""
    k_documents = q_documents if k_documents is None else k_documents
    allowed = q_documents[:, :, None] == k_documents[:, None, :]
    if causal:
        n_q, n_k = q_documents.shape[1], k_documents.shape[1]
        allowed &= torch.ones(n_q, n_k, dtype=torch.bool, device=allowed.device).tril()
    return allowed
