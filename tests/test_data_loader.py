"""Prepared datasets and their loader: samples are the shards' tokens and never cross a shard; every
data-parallel size sees the same global batches, also when resumed at another size; blends keep their
weights and order on any world size; damaged data and the wrong tokenizer are refused at open; opening a
large dataset reads none of it."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from prepared_data import make_docs, make_tokenizer, write_jsonl

from meshlm.data.dataset import BlendedDataset, PreparedDataset, open_dataset
from meshlm.data.loader import PreparedLoader
from meshlm.data.permutation import SeededPermutation
from meshlm.data.prepare import prepare

SEQ = 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(folder, tokenizer): 400 documents in ~15 shards, with a validation split."""
    root = tmp_path_factory.mktemp("prepared")
    tok = make_tokenizer(root / "tokenizer.json")
    write_jsonl(root / "a.jsonl", make_docs(400, seed=1))
    prepare([root / "a.jsonl"], tokenizer_path=tok, out=root / "out", shard_bytes=3000, val_fraction=0.2,
            progress=False)
    return root / "out", tok


def _shards(folder, split="train"):
    m = json.loads((folder / "manifest.json").read_text())
    return [(np.fromfile(folder / s["bin"], dtype=m["dtype"]).astype(np.int64), np.load(folder / s["idx"]))
            for s in m["splits"][split]["shards"]]


def test_samples_are_shard_windows_that_never_cross_a_shard(prepared):
    folder, tok = prepared
    ds = PreparedDataset(folder, seq_len=SEQ, tokenizer_path=tok, checksums=True)
    expected, starts = [], []
    for tokens, doc_starts in _shards(folder):
        for o in range(0, (len(tokens) - 1) // SEQ * SEQ, SEQ):
            expected.append(tokens[o: o + SEQ + 1])
            starts.append(doc_starts[(doc_starts >= o) & (doc_starts <= o + SEQ)] - o)
    assert len(ds) == len(expected) > 100
    everything = np.arange(len(ds))
    assert np.array_equal(ds.samples(everything).numpy(), np.stack(expected))
    inputs, targets = ds.batch(torch.tensor([3, 0]))
    assert torch.equal(inputs[1], torch.from_numpy(expected[0][:-1])) and torch.equal(targets[0][:-1], inputs[0][1:])
    assert [s.tolist() for s in ds.document_starts(everything)] == [s.tolist() for s in starts]
    val = PreparedDataset(folder, seq_len=SEQ, split="val")
    assert 0 < len(val) < len(ds)


def test_permutation_is_a_bijection_per_seed():
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        for key in (0, 1, 12345):
            assert sorted(SeededPermutation(n, key)(np.arange(n)).tolist()) == list(range(n))
    assert not np.array_equal(SeededPermutation(1000, 1)(np.arange(1000)), SeededPermutation(1000, 2)(np.arange(1000)))
    huge = SeededPermutation(10**12, 7)(np.arange(100_000))  # nothing of size 10^12 is built
    assert len(np.unique(huge)) == 100_000 and huge.max() < 10**12


def _run(ds, *, dp_size, steps, state=None, gbs=8, mbs=2, prefetch=True, seed=5) -> tuple[list, dict]:
    """Global batches (every rank's micro-batches concatenated in rank order) of `steps` steps, the end state."""
    loaders = [PreparedLoader(ds, global_batch_size=gbs, micro_batch_size=mbs, seq_len=SEQ, seed=seed, dp_rank=r,
                              dp_size=dp_size, prefetch=prefetch) for r in range(dp_size)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    batches = []
    for _ in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        assert all(len(p) == gbs // dp_size // mbs for p in parts)
        assert all(loader.last_wait_s >= 0 for loader in loaders)
        batches.append(torch.cat([x for p in parts for x, _ in p]))
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)
    for loader in loaders:
        loader.close()
    return batches, states[0]


def test_every_dp_size_sees_the_same_global_batches_across_epochs(prepared):
    ds = PreparedDataset(prepared[0], seq_len=SEQ)
    steps = len(ds) // 8 + 5  # into the second epoch
    one, state = _run(ds, dp_size=1, steps=steps)
    assert state["epoch"] == 1 and set(state) == {"epoch", "position", "seed", "num_samples", "global_batch_size"}
    for dp in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(one, _run(ds, dp_size=dp, steps=steps)[0]))
    assert all(torch.equal(a, b) for a, b in zip(one, _run(ds, dp_size=2, steps=steps, prefetch=False)[0]))
    reference = PreparedLoader(ds, global_batch_size=8, micro_batch_size=8, seq_len=SEQ, seed=5, prefetch=False)
    ids = [reference.next_global_indices() for _ in range(steps)]
    assert all(torch.equal(ds.batch(i)[0], b) for i, b in zip(ids, one))
    epoch0 = torch.cat(ids[: len(ds) // 8])
    assert len(set(epoch0.tolist())) == len(epoch0)  # an epoch visits each sample at most once
    assert not torch.equal(torch.cat(one[:5]), torch.cat(_run(ds, dp_size=1, steps=5, seed=6)[0]))


def test_resume_at_another_dp_size_continues_the_same_samples(prepared):
    ds = PreparedDataset(prepared[0], seq_len=SEQ)
    whole, _ = _run(ds, dp_size=1, steps=30)
    first, state = _run(ds, dp_size=2, steps=12)
    for dp in (1, 4):
        rest, _ = _run(ds, dp_size=dp, steps=18, state=state)
        assert all(torch.equal(a, b) for a, b in zip(whole, first + rest))
    with pytest.raises(ValueError, match="global_batch_size"):
        PreparedLoader(ds, global_batch_size=16, micro_batch_size=2, seq_len=SEQ, seed=5).load_state_dict(state)


def test_loader_reads_only_its_ranks_samples(prepared):
    ds = PreparedDataset(prepared[0], seq_len=SEQ)
    read = []
    batch = ds.batch
    ds.batch = lambda idx: (read.append(torch.as_tensor(idx).clone()), batch(idx))[1]
    loader = PreparedLoader(ds, global_batch_size=8, micro_batch_size=2, seq_len=SEQ, seed=5, dp_rank=1, dp_size=2,
                            prefetch=False)
    loader.next_batch()
    everything = PreparedLoader(PreparedDataset(prepared[0], seq_len=SEQ), global_batch_size=8, micro_batch_size=8,
                                seq_len=SEQ, seed=5, prefetch=False).next_global_indices()
    assert torch.equal(torch.cat(read), everything[4:8])
    assert torch.equal(torch.cat(loader.last_indices), everything[4:8])


def test_blend_weights_and_order_are_world_size_independent(prepared, tmp_path):
    folder, tok = prepared
    write_jsonl(tmp_path / "b.jsonl", make_docs(60, seed=7))
    prepare([tmp_path / "b.jsonl"], tokenizer_path=tok, out=tmp_path / "b", progress=False)
    spec = [{"path": folder, "weight": 5}, {"path": tmp_path / "b", "weight": 3}, {"path": folder, "weight": 2}]
    blend = open_dataset(spec, seq_len=SEQ)
    assert isinstance(blend, BlendedDataset)
    loader = PreparedLoader(blend, global_batch_size=100, micro_batch_size=25, seq_len=SEQ, seed=1, prefetch=False)
    ids = torch.cat([loader.next_global_indices() for _ in range(100)]).numpy()  # 10,000 samples, several epochs
    source = np.searchsorted(blend._offsets, ids, side="right") - 1
    assert np.abs(np.bincount(source, minlength=3) / len(ids) - [0.5, 0.3, 0.2]).max() < 0.01
    small = ids[source == 1] - blend._offsets[1]  # 60 documents, a few hundred samples: visited many times
    assert len(small) > 10 * len(blend.sources[1])
    first_pass = small[: len(blend.sources[1])]
    assert sorted(first_pass.tolist()) == list(range(len(blend.sources[1])))  # each sample once per pass
    batches, _ = _run(blend, dp_size=1, steps=20, gbs=20, mbs=5, seed=3)
    for dp in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(batches, _run(blend, dp_size=dp, steps=20, gbs=20, mbs=5,
                                                                   seed=3)[0]))
    blend.document_starts(ids[:10])
    with pytest.raises(ValueError, match="must be a positive number"):
        open_dataset([{"path": folder, "weight": 0}], seq_len=SEQ)


def test_damaged_data_and_the_wrong_tokenizer_are_refused_at_open(prepared, tmp_path):
    folder, _ = prepared
    copy = shutil.copytree(folder, tmp_path / "copy")
    shard = json.loads((copy / "manifest.json").read_text())["splits"]["train"]["shards"][2]
    data = bytearray((copy / shard["bin"]).read_bytes())
    data[5] ^= 0xFF
    (copy / shard["bin"]).write_bytes(bytes(data))  # same size: only the checksum sees it
    PreparedDataset(copy, seq_len=SEQ)
    with pytest.raises(ValueError, match=rf"{shard['bin']} does not match its sha256"):
        PreparedDataset(copy, seq_len=SEQ, checksums=True)
    (copy / shard["bin"]).write_bytes(bytes(data[:-3]))
    with pytest.raises(ValueError, match=rf"{shard['bin']} has \d+ bytes, the manifest says .* truncated"):
        PreparedDataset(copy, seq_len=SEQ)
    (copy / shard["idx"]).unlink()
    with pytest.raises(ValueError, match=rf"{shard['idx']} is missing"):
        PreparedDataset(copy, seq_len=SEQ)

    other = make_tokenizer(tmp_path / "other.json", eos=False)
    with pytest.raises(ValueError, match=r"tokenizer .*other\.json \(sha256 \w+\) is not the one .* prepared with "
                                         r"\(.*tokenizer\.json, sha256 \w+\)"):
        PreparedDataset(folder, seq_len=SEQ, tokenizer_path=other)
    noval = shutil.copytree(folder, tmp_path / "noval")
    m = json.loads((noval / "manifest.json").read_text())
    del m["splits"]["val"]
    (noval / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="has no split 'val' .* --val-fraction"):
        PreparedDataset(noval, seq_len=SEQ, split="val")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="is not a prepared dataset"):
        PreparedDataset(tmp_path / "plain", seq_len=SEQ)
    (tmp_path / "plain" / "progress").mkdir()
    with pytest.raises(ValueError, match="did not finish there"):
        PreparedDataset(tmp_path / "plain", seq_len=SEQ)
    with pytest.raises(ValueError, match="fewer than train.global_batch_size"):
        PreparedLoader(PreparedDataset(folder, seq_len=SEQ, split="val"), global_batch_size=10**6,
                       micro_batch_size=1, seq_len=SEQ, seed=0)


def _rss_anon_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    pytest.skip("no /proc/self/status RssAnon here")


def test_opening_and_reading_a_large_dataset_keeps_memory_flat(prepared, tmp_path):
    """A 128 MB shard (64M tokens, 8M samples): opening it and reading batches maps pages, copies none."""
    folder, _ = prepared
    big = shutil.copytree(folder, tmp_path / "big")
    m = json.loads((big / "manifest.json").read_text())
    shard = m["splits"]["train"]["shards"][0]
    num_tokens = 64 << 20
    with open(big / shard["bin"], "wb") as f:
        f.truncate(num_tokens * 2)  # sparse: no disk written
    np.save(big / "starts.npy", np.arange(0, num_tokens, 1000, dtype=np.int64))
    (big / "starts.npy").rename(big / shard["idx"])
    shard.update(num_tokens=num_tokens, num_documents=len(range(0, num_tokens, 1000)))
    (big / "manifest.json").write_text(json.dumps(m))
    before = _rss_anon_kib()
    ds = PreparedDataset(big, seq_len=SEQ)
    loader = PreparedLoader(ds, global_batch_size=64, micro_batch_size=16, seq_len=SEQ, seed=0)
    for _ in range(50):
        loader.next_batch()
        ds.document_starts(torch.cat(loader.last_indices))
    loader.close()
    assert len(ds) > 8_000_000
    assert _rss_anon_kib() - before < 16 * 1024  # far below the 128 MB of tokens and 0.5 MB index
