"""Data pipeline: tokenizers, sources, packing, the deterministic shuffle, data-parallel shards, resume."""

import json

import numpy as np
import pytest
import torch

from meshlm.config import DataConfig
from meshlm.tokenizer import ByteTokenizer, load_tokenizer
from meshlm.data.text import (
    BatchLoader,
    build_datasets,
    pack,
    read_documents,
    split_documents,
    stdlib_files,
    validation_batches,
)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte char decodes with replacement
    assert tok.encode_documents(["ab", "c"]).tolist() == tok.encode("ab\n\nc")


def test_packing_inputs_and_targets_shift_by_one():
    ds = pack(np.arange(21), seq_len=5)
    assert len(ds) == 4  # (21 - 1) // 5
    x, y = ds.batch(torch.tensor([0, 3]))
    assert x.dtype == torch.long and x.shape == (2, 5)
    assert x[0].tolist() == [0, 1, 2, 3, 4] and y[0].tolist() == [1, 2, 3, 4, 5]
    assert x[1].tolist() == [15, 16, 17, 18, 19] and y[1].tolist() == [16, 17, 18, 19, 20]


def test_sources_file_folder_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("bbb")
    (tmp_path / "d" / "a.txt").write_text("aaa")
    (tmp_path / "d" / "img.png").write_bytes(b"\x89PNG")
    assert read_documents(DataConfig(path=str(tmp_path / "d"))) == ["aaa", "bbb"]
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert read_documents(DataConfig(path=str(tmp_path / "x.jsonl"))) == ["one", "two"]
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1 has no string field 'text'"):
        read_documents(DataConfig(path=str(tmp_path / "bad.jsonl")))
    assert read_documents(DataConfig(path=str(tmp_path / "d" / "a.txt"), max_bytes=2)) == ["aa"]
    # a folder of JSONL shards is read by each line's `text` field, not as raw text
    (tmp_path / "d" / "c.jsonl").write_text(json.dumps({"text": "ccc"}) + "\n" + json.dumps({"text": "dd"}) + "\n")
    assert read_documents(DataConfig(path=str(tmp_path / "d"))) == ["aaa", "bbb", "ccc", "dd"]


def test_stdlib_corpus_is_deterministic_and_capped():
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
    docs = read_documents(DataConfig(max_bytes=200_000))
    assert sum(len(d.encode()) for d in docs) == 200_000
    assert docs == read_documents(DataConfig(max_bytes=200_000))
    train, val = split_documents(docs, 0.2)
    assert val and train and len(train) + len(val) == len(docs)
    assert split_documents(docs, 0.2) == (train, val)


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    hf = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.vocab_size == 5 and tok.eos_token_id == 1
    assert tok.encode("ab a") == [4, 2]
    assert tok.encode_documents(["ab", "b"]).tolist() == [4, 1, 3, 1]


def _dataset(n_samples=64, seq_len=4):
    return pack(np.arange(n_samples * seq_len + 1) % 251, seq_len)


def test_shuffle_is_deterministic_and_reshuffles_each_epoch():
    ds = _dataset(32)

    def order(seed, steps):
        loader = BatchLoader(ds, global_batch_size=8, micro_batch_size=8, seq_len=4, seed=seed)
        return [loader.next_global_indices().tolist() for _ in range(steps)]

    a = order(0, 8)
    assert a == order(0, 8)
    assert a != order(1, 8)
    epoch0, epoch1 = sum(a[:4], []), sum(a[4:], [])
    assert sorted(epoch0) == list(range(32)) == sorted(epoch1)  # each epoch visits every sample once
    assert epoch0 != epoch1


def test_dp_shards_are_disjoint_and_cover_the_global_batch():
    ds = _dataset(64)
    full = BatchLoader(ds, global_batch_size=16, micro_batch_size=16, seq_len=4, seed=3)
    ranks = [BatchLoader(ds, global_batch_size=16, micro_batch_size=2, seq_len=4, seed=3, dp_rank=r, dp_size=4)
             for r in range(4)]
    for _ in range(5):
        (x_full, y_full), = full.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert all(len(p) == 2 for p in parts)  # 16 / 4 ranks / micro 2
        x = torch.cat([mb[0] for p in parts for mb in p])
        y = torch.cat([mb[1] for p in parts for mb in p])
        assert torch.equal(x, x_full) and torch.equal(y, y_full)


def test_batch_divisibility_errors_name_the_numbers():
    ds = _dataset(64)
    with pytest.raises(ValueError, match="global_batch_size=10 must be divisible by the data-parallel size 4"):
        BatchLoader(ds, global_batch_size=10, micro_batch_size=1, seq_len=4, seed=0, dp_size=4)
    with pytest.raises(ValueError, match="=4 must be divisible by train.micro_batch_size=3"):
        BatchLoader(ds, global_batch_size=8, micro_batch_size=3, seq_len=4, seed=0, dp_size=2)
    with pytest.raises(ValueError, match="fewer than train.global_batch_size=128"):
        BatchLoader(ds, global_batch_size=128, micro_batch_size=8, seq_len=4, seed=0)


def test_loader_resume_continues_the_same_sequence():
    ds = _dataset(40)
    a = BatchLoader(ds, global_batch_size=8, micro_batch_size=4, seq_len=4, seed=7)
    for _ in range(7):  # crosses an epoch boundary (5 batches per epoch)
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives serialisation
    b = BatchLoader(ds, global_batch_size=8, micro_batch_size=4, seq_len=4, seed=7)
    b.load_state_dict(state)
    for _ in range(6):
        for (xa, ya), (xb, yb) in zip(a.next_batch(), b.next_batch()):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = BatchLoader(ds, global_batch_size=8, micro_batch_size=4, seq_len=4, seed=8)
    with pytest.raises(ValueError, match="saved seed=7, now 8"):
        c.load_state_dict(state)


def test_build_datasets_and_validation_batches(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world. " * 400)
    train, val = build_datasets(DataConfig(path=str(path), val_fraction=0.1), seq_len=16, tokenizer=ByteTokenizer())
    assert len(train) > 0 and len(val) > 0
    assert train.tokens.numel() + val.tokens.numel() == len(("hello world. " * 400).encode())
    batches = validation_batches(val, num_batches=3, micro_batch_size=2)
    assert len(batches) == 3 and batches[0][0].shape == (2, 16)
    halves = [validation_batches(val, num_batches=4, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    assert len(halves[0]) == len(halves[1]) == 2
    with pytest.raises(ValueError, match="fewer than one sample"):
        build_datasets(DataConfig(path=str(path), max_bytes=10), seq_len=16, tokenizer=ByteTokenizer())
