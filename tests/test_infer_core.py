"""Torch-free tests of the engine's core: Sequence, BlockManager (prefix caching), Scheduler.

A fake "KV cache" records which token each slot holds, so the property tests check not only the
bookkeeping (no leaks, reference counts, budget, everyone finishes) but also that every sequence
attends to exactly its own tokens, whether they came from a prefix-cache hit or were computed.
"""

import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlm.infer.block_manager import BlockManager
from meshlm.infer.scheduler import Scheduler
from meshlm.infer.sequence import SamplingParams, Sequence, SequenceStatus


def test_core_does_not_import_torch():
    import subprocess

    code = ("import sys; import meshlm.infer.scheduler, meshlm.infer.block_manager, meshlm.infer.sequence; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sampling_params_validation():
    assert SamplingParams(stop="x").stop == ["x"]
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(max_tokens=-3), dict(logprobs=99),
                dict(seed=2**64), dict(seed=1.5), dict(logprobs=2.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert type(SamplingParams(top_k=3.0).top_k) is int  # torch.topk refuses a float k
    with pytest.raises(ValueError):
        Sequence([])


def test_prefix_cache_hit_and_token_check():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(10)))
    assert bm.match_prefix(a) == 0
    assert bm.ensure_slots(a, 10)
    a.num_computed_tokens = 10
    bm.commit(a)  # blocks 0..1 full -> cached
    b = Sequence(list(range(8)) + [99, 98, 97])
    assert bm.match_prefix(b) == 8 and b.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    # A prompt that is exactly the cached blocks still leaves its last token to compute.
    c = Sequence(list(range(8)))
    assert bm.match_prefix(c) == 4
    # A hash collision is caught by the token comparison.
    d = Sequence([0, 1, 2, 3, 5, 5, 5, 5, 1])
    h0 = bm.seq_hashes[a.seq_id][0]
    bm.cached[bm._chain_hash(h0, (5, 5, 5, 5))] = a.block_table[1]  # forge a colliding entry
    assert bm.match_prefix(d) == 4
    del bm.cached[bm._chain_hash(h0, (5, 5, 5, 5))]
    for s in (a, b, c, d):
        bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])
    # Freed cached blocks are still hits until their space is reused.
    e = Sequence(list(range(9)))
    assert bm.match_prefix(e) == 8
    assert bm.hit_rate > 0


def test_prefix_cache_chains_past_a_duplicate_parent():
    # a and b miss together (admitted in the same step), so b's first block duplicates a's cached one;
    # b's second block, cached on top of that duplicate, must still be a hit for a later c.
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = Sequence(list(range(5))), Sequence(list(range(4)) + [9, 9, 9, 9, 1])
    for seq in (a, b):
        assert bm.match_prefix(seq) == 0 and bm.ensure_slots(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)
    c = Sequence(list(range(4)) + [9, 9, 9, 9, 2])
    assert bm.match_prefix(c) == 8
    assert c.block_table == [a.block_table[0], b.block_table[1]]
    bm.check_invariants([a, b, c])


def test_scheduler_rejects_requests_that_can_never_fit():
    sched = Scheduler(BlockManager(num_blocks=2, block_size=4))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(Sequence(list(range(5)), SamplingParams(max_tokens=10)))


def test_chunked_prefill_and_decode_mix():
    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_batched_tokens=8)
    a = Sequence(list(range(3)), SamplingParams(max_tokens=4))
    b = Sequence(list(range(100, 120)), SamplingParams(max_tokens=2))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 3), (b, 5)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    sched.update(out, {a.seq_id: (7, None)})
    out = sched.schedule()  # a decodes (1 token), b continues its prefill with the rest of the budget
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]


def _simulate(requests, *, num_blocks, block_size, budget, max_num_seqs, chunked, prefix, arrivals_per_step):
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    slot_token = {}  # fake KV cache: slot -> the token whose KV it holds
    pending = list(requests)
    seqs = []
    steps = 0
    limit = 50 + 4 * sum(s.max_total_tokens for s in requests)
    while pending or sched.has_unfinished():
        for _ in range(arrivals_per_step):
            if pending:
                seq = pending.pop(0)
                try:
                    sched.add(seq)
                    seqs.append(seq)
                except ValueError:
                    assert bm.blocks_needed(seq.max_total_tokens) > num_blocks or not chunked
        out = sched.schedule()
        steps += 1
        assert steps < limit, "a request starves"
        assert out.num_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        if sched.has_unfinished() and not pending and not out.scheduled:
            raise AssertionError("no progress with unfinished requests")
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        sampled = {}
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            assert end <= seq.num_tokens and len(seq.block_table) * block_size >= end
            slot = lambda p: seq.block_table[p // block_size] * block_size + p % block_size  # noqa: E731
            for p in range(start):  # what attention reads must be this sequence's own tokens
                assert slot_token.get(slot(p)) == seq.token_at(p), "wrong KV content"
            for p in range(start, end):
                slot_token[slot(p)] = seq.token_at(p)
            if item.samples:
                sampled[seq.seq_id] = ((seq.token_at(end - 1) * 7 + 3) % 11, None)
        sched.update(out, sampled)
        live = sched.running + [s for s in sched.waiting if s.block_table]
        bm.check_invariants(live)
        assert all(not s.block_table for s in sched.waiting)
        assert 0 <= bm.num_hit_tokens <= bm.num_queried_tokens
    for seq in seqs:
        assert seq.is_finished and seq.finish_reason == "length"
        assert len(seq.output_token_ids) == seq.params.max_tokens
    assert bm.num_free_blocks == num_blocks, "block leak"
    assert all(r == 0 for r in bm.ref_counts)
    return sched, bm


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(4, 40))
    prefixes = [draw(st.lists(st.integers(0, 3), min_size=0, max_size=12)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prefix = prefixes[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(0, 10), min_size=1, max_size=10))
        requests.append(Sequence(prefix + tail, SamplingParams(max_tokens=draw(st.integers(1, 8)))))
    return dict(
        requests=requests, num_blocks=num_blocks, block_size=block_size,
        budget=draw(st.integers(1, 24)), max_num_seqs=draw(st.integers(1, 5)),
        chunked=draw(st.booleans()), prefix=draw(st.booleans()), arrivals_per_step=draw(st.integers(1, 3)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_properties(workload):
    _simulate(**workload)


def test_preemption_and_prefix_hits_happen():
    shared = list(range(8))
    reqs = [Sequence(shared + [20 + i], SamplingParams(max_tokens=6)) for i in range(6)]
    sched, bm = _simulate(reqs, num_blocks=12, block_size=2, budget=16, max_num_seqs=6, chunked=True,
                          prefix=True, arrivals_per_step=6)
    assert sched.num_preemptions > 0
    assert bm.num_hit_tokens > 0
