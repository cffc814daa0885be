"""Speculative decoding's torch-free parts: the n-gram proposer, the config's refusals, and the scheduler and
block manager under proposals -- slots reserved for the k + 1 fed tokens, only accepted tokens counted as
computed (and cached), the rejected proposals' blocks given back.

The scheduler property test drives a fake model (next token = a fixed function of the last one) and a fake KV
cache that records which token each slot holds: every sequence must attend exactly its own accepted tokens,
whatever was proposed, accepted, chunked, preempted or found in the prefix cache; every block comes back.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlm.infer.block_manager import BlockManager
from meshlm.infer.scheduler import Scheduler
from meshlm.infer.sequence import SamplingParams, Sequence
from meshlm.infer.speculative import NgramProposer, SpeculativeConfig


def test_ngram_lookup_proposes_the_latest_continuation():
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, ngram=(1, 3)))
    #              0  1  2  3  4  5  6  7  8  9
    assert prop.lookup([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7], 3) == [1, 2, 5]  # latest "5 6 7" wins
    assert prop.lookup([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]  # the continuation runs into the suffix itself
    assert prop.lookup([1, 2, 3], 2) == []  # no earlier occurrence of any n-gram
    assert prop.lookup([4, 4], 5) == [4]
    assert prop.lookup([7], 3) == []
    longest = NgramProposer(SpeculativeConfig(ngram=(2, 2)))
    assert longest.lookup([9, 1, 9, 2, 8, 9, 2], 2) == [8, 9]  # "9 2" matched, not the later lone 9


@pytest.mark.parametrize("bad, match", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens=0 must be an integer >= 1"),
    (dict(num_speculative_tokens=2.5), "num_speculative_tokens=2.5"),
    (dict(ngram=(3, 2)), "ngram=.* 1 <= min <= max"),
    (dict(ngram=(0, 2)), "ngram="),
    (dict(method="eagle"), "method 'eagle' is not one of"),
    (dict(method="draft"), "needs a draft model"),
    (dict(model="some/dir"), "use method 'draft'"),
])
def test_config_refusals(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**bad)


def test_config_of_and_context():
    assert SpeculativeConfig.of(None) is None
    assert SpeculativeConfig.of({"num_speculative_tokens": 2}).num_speculative_tokens == 2
    with pytest.raises(ValueError, match="unknown fields"):
        SpeculativeConfig.of({"k": 2})
    with pytest.raises(ValueError, match="=64 does not fit the context length 64; use at most 62"):
        SpeculativeConfig(num_speculative_tokens=64).check_context(64)
    SpeculativeConfig(num_speculative_tokens=62).check_context(64)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        SamplingParams(num_speculative_tokens=0)


def test_proposals_reserve_slots_and_rejected_blocks_come_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=32)
    seq = Sequence(list(range(1, 6)), SamplingParams(max_tokens=20))
    sched.add(seq)
    out = sched.schedule()  # the prefill: 5 tokens, 2 blocks
    sched.update(out, {seq.seq_id: (9, None)})
    assert (seq.num_tokens, seq.num_computed_tokens, len(seq.block_table)) == (6, 5, 2)
    seq.spec_token_ids = [10, 11, 12, 13, 14]
    out = sched.schedule()
    [item] = out.scheduled
    assert (item.num_new_tokens, item.num_spec_tokens, item.samples) == (6, 5, True)
    assert len(seq.block_table) == 3  # positions 5..10: slots up to 11 tokens
    sched.update(out, {seq.seq_id: [(10, None), (11, None), (7, None)]})  # 2 accepted, then the target's own
    assert seq.output_token_ids == [9, 10, 11, 7] and seq.num_computed_tokens == 8 and seq.num_tokens == 9
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3  # blocks for 9 tokens kept
    assert len(bm.seq_hashes[seq.seq_id]) == 2  # the full blocks of accepted tokens: 0..7
    seq.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out = sched.schedule()
    assert out.scheduled[0].num_spec_tokens == 6 and len(seq.block_table) == 4
    sched.update(out, {seq.seq_id: [(8, None)]})  # the first proposal rejected
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3 and seq.num_computed_tokens == 9
    bm.check_invariants([seq])
    # never more tokens than the request may still emit: 20 - 5 = 15 left, 1 of them fed plainly
    seq.spec_token_ids = list(range(40))
    assert sched.schedule().scheduled[0].num_spec_tokens == 20 - 5 - 1


def test_no_room_for_proposals_is_a_plain_decode_not_a_preemption():
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=32)
    a, b = Sequence([1, 2, 3], SamplingParams(max_tokens=4)), Sequence([4, 5, 6], SamplingParams(max_tokens=4))
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()
    sched.update(out, {a.seq_id: (7, None), b.seq_id: (8, None)})
    a.spec_token_ids, b.spec_token_ids = [1, 2], [3, 4]  # a takes the last free block; b finds none
    out = sched.schedule()
    assert [(i.seq, i.num_spec_tokens) for i in out.scheduled] == [(a, 2), (b, 0)] and not out.preempted
    assert b.spec_token_ids == []


def test_a_stop_among_accepted_proposals_ends_there():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[42]))
    sched.add(seq)
    sched.update(sched.schedule(), {seq.seq_id: (5, None)})
    seq.spec_token_ids = [6, 42, 7]
    out = sched.schedule()
    finished = sched.update(out, {seq.seq_id: [(6, None), (42, None), (7, None), (9, None)]})
    assert finished == [seq] and seq.output_token_ids == [5, 6, 42] and seq.finish_reason == "stop"
    assert bm.num_used_blocks == 0


def _next(token: int) -> int:
    return (token * 7 + 3) % 11


def _step_with_proposals(sched, bm, draw, slot_token, block_size):
    """Propose for every running decode (some right, some wrong), run one scheduled step on the fake model."""
    for seq in sched.running:
        seq.spec_token_ids = []
        if seq.num_computed_tokens == seq.num_tokens - 1:
            truth, t = [], seq.token_ids[-1]
            for _ in range(draw(st.integers(0, 5))):
                t = _next(t)
                truth.append(t)
            wrong = draw(st.integers(0, len(truth)))
            seq.spec_token_ids = truth[:wrong] + [(x + 1) % 11 for x in truth[wrong:]]
    out = sched.schedule()
    sampled = {}
    for item in out.scheduled:
        seq = item.seq
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
        assert len(seq.block_table) * block_size >= end
        slot = lambda p: seq.block_table[p // block_size] * block_size + p % block_size
        for p in range(start):  # what attention reads must be this sequence's own (accepted) tokens
            assert slot_token.get(slot(p)) == seq.token_at(p), "wrong KV content"
        for p in range(start, end):
            slot_token[slot(p)] = seq.token_at(p)
        if item.samples:
            fed = [seq.token_at(p) for p in range(end - 1 - item.num_spec_tokens, end)]
            emitted = []
            for j, proposal in enumerate(seq.spec_token_ids):  # greedy verification against the fake model
                if proposal != _next(fed[j]):
                    break
                emitted.append(proposal)
            emitted.append(_next(fed[len(emitted)]))
            sampled[seq.seq_id] = [(t, None) for t in emitted]
    assert out.num_tokens <= sched.max_num_batched_tokens
    sched.update(out, sampled)
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_scheduler_with_proposals_properties(data):
    draw = data.draw
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(6, 40))
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=draw(st.booleans()))
    sched = Scheduler(bm, max_num_seqs=draw(st.integers(1, 5)), max_num_batched_tokens=draw(st.integers(2, 24)))
    prefix = draw(st.lists(st.integers(0, 10), max_size=9))
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        seq = Sequence(prefix + draw(st.lists(st.integers(0, 10), min_size=1, max_size=6)),
                       SamplingParams(max_tokens=draw(st.integers(1, 12))))
        if bm.blocks_needed(seq.max_total_tokens) <= num_blocks:
            sched.add(seq)
            seqs.append(seq)
    slot_token, steps = {}, 0
    while sched.has_unfinished():
        _step_with_proposals(sched, bm, draw, slot_token, block_size)
        steps += 1
        assert steps < 400, "a request starves"
        bm.check_invariants(sched.running + [s for s in sched.waiting if s.block_table])
        for block, (_, _, tokens) in bm.block_info.items():  # cached blocks hold accepted tokens only
            assert tuple(slot_token[block * block_size + i] for i in range(block_size)) == tokens
    for seq in seqs:  # every token is the fake model's: exactly what decoding without proposals gives
        assert len(seq.output_token_ids) == seq.params.max_tokens
        tokens = seq.token_ids
        assert all(tokens[i + 1] == _next(tokens[i]) for i in range(seq.num_prompt_tokens - 1, seq.num_tokens - 1))
    assert bm.num_free_blocks == num_blocks, "block leak"
