"""Document masking (data.document_mask): the definition, the data that feeds it and every attention variant.

- the definition, independent of the implementation: a packed batch through the masked model gives, per token,
  the logits (and the loss and every gradient) of running each document alone through the plain model from
  position 0; and the mask matters (a multi-document sample's loss changes), while one document is the causal run;
- the representation (`meshlm.models.documents`) and the packing that records where documents begin;
- context parallelism's ring, all-gather, Ulysses and hybrid attention with `documents` against dense SDPA with
  the block-causal mask (output and every gradient, fp64 to FP64_TOL), with no more bytes on "cp" than without;
- activation recomputation (selective and full) keeps the masked gradients bit for bit.
The training runs under every layout against one process are tests/test_train_document_mask.py.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.config import DataConfig, load_config
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.models.documents import attention_mask, document_positions, documents_from_starts
from meshlm.parallel.context import (
    _pairs,
    allgather_attention,
    hybrid_attention,
    hybrid_mesh,
    local_positions,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from meshlm.parallel.recompute import apply_recompute
from meshlm.tokenizer import ByteTokenizer
from meshlm.data.text import BatchLoader, pack_documents, validation_batches
from parity import FP64_TOL
from runs import SMALL_MODEL

SEQ = 24
# Document starts per sample: several documents, one of a single token (5), a start at 0 and one not, a start
# at the sample's end (ignored: it opens the next sample's first document).
STARTS = [[0, 5, 6, 13, 24], [3, 11]]


def _model(**overrides):
    cfg = load_config(overrides=[*SMALL_MODEL, "train.seq_len=32", "model.qk_norm=true",
                                 *[f"model.{k}={v}" for k, v in overrides.items()]]).model
    return build_model(cfg, seed=3, dtype=torch.float64)


def _tokens(batch=2, seq=SEQ):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))


def _segments(starts, seq):
    """[(begin, end)] of each document of a sample of `seq` tokens."""
    bounds = sorted({0, seq, *(s for s in starts if 0 <= s < seq)})
    return list(zip(bounds, bounds[1:]))


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def test_documents_from_starts_and_their_positions():
    docs = documents_from_starts(STARTS, SEQ)
    assert docs[0].tolist() == [0] * 5 + [1] + [2] * 7 + [3] * 11
    assert docs[1].tolist() == [0] * 3 + [1] * 8 + [2] * 13
    assert documents_from_starts([[0, 4, 4]], 6).tolist() == [[0, 0, 0, 0, 1, 1]]  # an empty document
    pos = document_positions(docs)
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6] + list(range(11))
    assert pos[1].tolist() == [0, 1, 2] + list(range(8)) + list(range(13))
    # a context-parallel rank's tokens: the positions' part, per sequence
    mine = local_positions(SEQ, cp=2, cp_rank=1)
    assert document_positions(docs, mine).tolist() == pos[:, mine].tolist()
    mask = attention_mask(docs)
    assert mask[0, 6, 5].item() is False and mask[0, 7, 6].item() is True and mask[0, 6, 7].item() is False
    assert torch.equal(mask[1], mask[1].tril())
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        document_positions(docs[0])


def test_the_masked_model_is_each_document_run_alone():
    """Per token, logits, loss and gradients equal running every document alone (positions from 0)."""
    model, tokens = _model(), _tokens()
    targets = torch.roll(tokens, -1, dims=1)
    docs = documents_from_starts(STARTS, SEQ)
    logits = model(tokens, documents=docs)
    _loss(logits, targets).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    want = torch.empty_like(logits)
    for row, starts in enumerate(STARTS):
        for a, b in _segments(starts, SEQ):
            alone = model(tokens[row:row + 1, a:b])
            _loss(alone, targets[row:row + 1, a:b]).backward()  # the losses add up, so do the gradients
            want[row, a:b] = alone[0].detach()
    assert (logits.detach() - want).abs().max().item() <= FP64_TOL
    assert abs(_loss(logits.detach(), targets) - _loss(want, targets)).item() <= FP64_TOL
    for name, p in model.named_parameters():
        assert (got[name] - p.grad).abs().max().item() <= FP64_TOL, name


def test_the_mask_changes_a_multi_document_loss_and_one_document_is_the_causal_run():
    model, tokens = _model(), _tokens()
    targets = torch.roll(tokens, -1, dims=1)
    masked = _loss(model(tokens, documents=documents_from_starts(STARTS, SEQ)), targets)
    plain = _loss(model(tokens), targets)
    assert abs(masked - plain).item() > 1e-3  # a model that ignored `documents` fails here
    one = model(tokens, documents=torch.zeros_like(tokens))
    assert (one - model(tokens)).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match="documents=None"):
        from meshlm.models.transformer import KVCache

        model(tokens, documents=torch.zeros_like(tokens), cache=KVCache(model.config, 2, SEQ, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_keeps_the_masked_gradients(mode):
    tokens = _tokens()
    docs, targets = documents_from_starts(STARTS, SEQ), torch.roll(tokens, -1, dims=1)
    grads = []
    for recompute in ("none", mode):
        model = apply_recompute(_model(), recompute)
        _loss(model(tokens, documents=docs), targets).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_packing_records_where_documents_begin(tmp_path):
    # bytes: documents joined by a blank line, which ends the document before it
    texts = ["abc", "", "defgh", "ij"]
    tokens, starts = ByteTokenizer().encode_with_starts(texts)
    assert bytes(tokens.astype("uint8")) == b"abc\n\n\n\ndefgh\n\nij" and starts.tolist() == [0, 5, 7, 14]
    assert ByteTokenizer().encode_documents(texts).tolist() == tokens.tolist()
    ds = pack_documents(texts, ByteTokenizer(), 5)  # 16 tokens: samples [0, 6), [5, 11), [10, 16)
    assert [s.tolist() for s in ds.document_starts(torch.tensor([0, 1, 2]))] == [[0, 5], [0, 2], [4]]
    x, y, docs = validation_batches(ds, num_batches=1, micro_batch_size=3, documents=True)[0]
    assert docs.tolist() == [[0] * 5, [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert [t.tolist() for t in (x, y)] == [t.tolist() for t in validation_batches(ds, num_batches=1,
                                                                                  micro_batch_size=3)[0]]
    on = BatchLoader(ds, global_batch_size=2, micro_batch_size=1, seq_len=5, seed=0, documents=True)
    off = BatchLoader(ds, global_batch_size=2, micro_batch_size=1, seq_len=5, seed=0)
    for with_docs, without in zip(on.next_batch(), off.next_batch()):
        assert len(with_docs) == 3 and len(without) == 2
        assert all(torch.equal(a, b) for a, b in zip(with_docs, without))
    assert DataConfig().document_mask is False  # off by default: today's behaviour
    with pytest.raises(ValueError, match="pack_documents"):
        from meshlm.data.text import pack

        pack(tokens, 5).document_starts(torch.tensor([0]))


# -- context parallelism ----------------------------------------------------------------------------------

CP_SHAPE = dict(batch=2, heads=4, kv_heads=2, seq=16, dim=8)
# chunks of 2 tokens at cp=4 (of 4 at cp=2): starts on and off chunk edges, a document spanning many chunks;
# chunk pairs whose queries see none of the keys in one sequence but some in the other (their rows filled with the
# lowest finite score), and pairs that see nothing of each other in either (skipped)
CP_STARTS = [[0, 3, 4, 9, 15], [8]]
ATTEND = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def _qkv(*, batch, heads, kv_heads, seq, dim):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64),
            torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64),
            torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64),
            torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64))


def _dense_masked(q, k, v, dout, docs):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=attention_mask(docs)[:, None])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def masked_attention_worker(rank, world_size):
    """Every method with and without documents on this rank's chunks: whole output and gradients, bytes on cp."""
    mesh = build_mesh(ParallelDims(cp=world_size), device_type="cpu")
    usp2 = hybrid_mesh(mesh, 2) if world_size == 4 else None
    methods = dict(ATTEND, **({"usp2": lambda q, k, v, _, documents: hybrid_attention(q, k, v, usp2,
                                                                                       documents=documents)}
                              if usp2 is not None else {}))
    docs = documents_from_starts(CP_STARTS, CP_SHAPE["seq"])
    q, k, v, dout = _qkv(**CP_SHAPE)
    results = {}
    for method, attend in methods.items():
        for documents in (docs, None):
            mine = [shard_sequence(t, cp=world_size, cp_rank=rank, dim=2).requires_grad_(True) for t in (q, k, v)]
            mesh.stats.reset()
            out = attend(*mine, mesh, documents=documents)
            out.backward(shard_sequence(dout, cp=world_size, cp_rank=rank, dim=2))
            moved = {key: s.bytes for key, s in mesh.stats.snapshot().items()}
            full = [unshard_sequence(t, mesh, dim=2) for t in (out.detach(), *(m.grad for m in mine))]
            results[method, documents is not None] = (full, moved)
    return results


@functools.lru_cache(maxsize=None)
def _launched(cp):
    return run_distributed(masked_attention_worker, cp)


def test_chunk_pairs_of_other_documents_only_are_skipped():
    docs = documents_from_starts(CP_STARTS, CP_SHAPE["seq"])
    # cp=4, rank 0 holds chunks 0 and 7 (2 tokens each): chunk 7 (tokens 14, 15) sees nothing of chunk 0 in
    # either sequence; chunk 3 (tokens 6, 7) sees chunk 0 in the second sequence only
    assert [(qs.start, ks.start) for qs, ks, *_ in _pairs((0, 7), (0, 7), 2)] == [(0, 0), (2, 0), (2, 2)]
    assert [(qs.start, ks.start) for qs, ks, *_ in _pairs((0, 7), (0, 7), 2, docs)] == [(0, 0), (2, 2)]
    (_, _, causal, allowed), = _pairs((3,), (0,), 2, docs)
    assert not causal and allowed.flatten(1).any(1).tolist() == [False, True]


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_is_block_causal(cp):
    q, k, v, dout = _qkv(**CP_SHAPE)
    want = _dense_masked(q, k, v, dout, documents_from_starts(CP_STARTS, CP_SHAPE["seq"]))
    for rank, results in enumerate(_launched(cp)):
        for (method, masked), (got, moved) in results.items():
            if not masked:
                continue
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                diff = (g - w).abs().max().item()
                assert diff <= FP64_TOL, f"rank {rank} {method} cp={cp}: {name} differs by {diff:.3g}"
            # the documents travel nowhere: the same collectives and bytes as causal attention
            assert moved == results[method, False][1], (method, moved)
