"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Responsible for: first-come-first-served admission of waiting requests, chunked prefill under a
per-step token budget mixed with the decodes of running requests, preemption by recompute (the
newest running request gives its blocks back and is prefilled again later) when KV blocks run out,
and the bookkeeping after a step (computed tokens, appended samples, finishing).
Speculative decoding: a decoding sequence with proposals (`Sequence.spec_token_ids`, set by the engine) is
fed its last token and k proposals in one step, k capped by the step's budget and the tokens the sequence may
still emit; slots are reserved for all k + 1, or for none of the proposals when the cache lacks them
(speculation never preempts anyone). After the step only the accepted tokens count as computed -- so only
their blocks reach the prefix cache -- and the blocks past them are given back.
Not responsible for: tensors or sampling (model_runner.py, sampling.py), stop strings (the engine
detokenizes and calls `finish`), proposing tokens (speculative.py, draft.py). No torch import here.

Why no request starves: the waiting queue is served strictly in order (a request that does not fit
blocks those behind it), preemption always picks the newest running request, and a request is only
accepted if it fits in the whole cache alone -- so the oldest request always makes progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from meshlm.infer.block_manager import BlockManager
from meshlm.infer.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, from seq.num_computed_tokens on (proposals included)
    num_spec_tokens: int = 0  # of them, proposals (the last ones: seq.spec_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last token, so its logits give a new token (and, with
        proposals, the logits of each proposal's position: num_spec_tokens + 1 rows)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + self.num_spec_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- requests ---------------------------------------------------------------------------------

    def check(self, seq: Sequence) -> None:
        """ValueError if the request could never run here (it would wait forever)."""
        bm = self.block_manager
        if bm.blocks_needed(seq.max_total_tokens) > bm.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs up to {seq.max_total_tokens} tokens "
                f"({bm.blocks_needed(seq.max_total_tokens)} KV blocks) but the cache has {bm.num_blocks} blocks; "
                "lower max_tokens, shorten the prompt, or give the KV cache more memory")
        if not self.enable_chunked_prefill and seq.max_total_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {seq.request_id!r} needs {seq.max_total_tokens} tokens in one step without chunked "
                f"prefill, above max_num_batched_tokens={self.max_num_batched_tokens}; enable chunked prefill")

    def most_tokens_per_sequence(self) -> int:
        """The most tokens one request can hold here (`check`'s limits): the whole KV cache, and without chunked
        prefill one step's budget."""
        bm = self.block_manager
        most = bm.num_blocks * bm.block_size
        return most if self.enable_chunked_prefill else min(most, self.max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (stop condition met, or aborted) and free its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- sequences moving between engines (disaggregated prefill and decode) -----------------------

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out of this scheduler, its blocks still held (their KV is about to be copied
        to another engine); `block_manager.free(seq)` gives them back afterwards."""
        self.running.remove(seq)
        seq.spec_token_ids = []

    def adopt(self, seq: Sequence, num_computed: int) -> int | None:
        """Admit a sequence whose first `num_computed` tokens' KV another engine computed: it runs from the next
        step on, as if this engine had prefilled it. Returns how many of those tokens the prefix cache already
        holds -- the KV of the others must be written into its blocks (`seq.block_table`) before the next
        step -- or None (nothing changed) when there is no room: no free slot or too few free blocks."""
        bm = self.block_manager
        if len(self.running) >= self.max_num_seqs:
            return None
        assert not seq.block_table and 0 < num_computed < seq.num_tokens
        cached = min(bm.match_prefix(seq), num_computed)
        if not bm.ensure_slots(seq, num_computed):
            bm.unmatch(seq)
            return None
        seq.num_computed_tokens = num_computed
        bm.commit(seq)  # its full blocks join the prefix cache (their KV lands before any step reads it)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return cached

    # ---- one step -----------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # Running requests first, oldest first: decodes and the rest of chunked prefills.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert n > 0
            k = self._num_proposals(seq, n, budget)
            if k and not bm.ensure_slots(seq, seq.num_computed_tokens + n + k):
                k = 0  # no room for the proposals: a plain decode (speculation preempts no one)
            seq.spec_token_ids = seq.spec_token_ids[:k]
            n += k
            while not bm.ensure_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]  # the newest; possibly `seq` itself
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, n, k))
                budget -= n
                i += 1
                continue
            break  # `seq` itself was preempted: everything after it was preempted too

        # Then new requests in arrival order, unless memory was short this step.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            bm.match_prefix(seq)  # a waiting sequence holds no blocks: it starts from the prefix cache
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if (n < remaining and not self.enable_chunked_prefill) or not bm.ensure_slots(seq, seq.num_computed_tokens + n):
                bm.unmatch(seq)  # give back the prefix hits; retried next step, still first in line
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return out

    @staticmethod
    def _num_proposals(seq: Sequence, n: int, budget: int) -> int:
        """How many of a decoding sequence's proposals fit this step: within the budget and never more tokens
        than the sequence may still emit (k accepted + one from the target)."""
        if n != 1 or not seq.spec_token_ids:
            return 0
        return max(0, min(len(seq.spec_token_ids), budget - 1, seq.max_total_tokens - seq.num_tokens - 1))

    def update(self, out: SchedulerOutput, sampled: dict[int, tuple[int, dict | None] | list]) -> list[Sequence]:
        """Account a finished step: `sampled[seq_id] = (token, logprobs or None)` for sampling rows, or a list
        of them for a sequence whose proposals were verified (the accepted proposals, then the target's token).

        Returns the sequences that finished by token or length (stop strings are the engine's).
        """
        finished = []
        for item in out.scheduled:
            seq = item.seq
            if not item.samples:
                seq.num_computed_tokens += item.num_new_tokens
                self.block_manager.commit(seq)
                continue
            emitted = sampled[seq.seq_id]
            emitted = emitted if isinstance(emitted, list) else [emitted]
            reason = self._append(item, emitted)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif item.num_spec_tokens:
                self.block_manager.trim(seq, seq.num_tokens)  # the rejected proposals' blocks
        return finished

    def _append(self, item: ScheduledSequence, emitted: list[tuple[int, dict | None]]) -> str | None:
        """Append a sampling sequence's emitted tokens up to the first stop; count as computed the fed tokens
        that were not rejected proposals, and cache their full blocks. Returns the finish reason, if any."""
        seq, k = item.seq, item.num_spec_tokens
        accepted = len(emitted) - 1  # proposals accepted (they lead `emitted`)
        assert 0 <= accepted <= k
        start = seq.num_computed_tokens
        reason, appended = None, 0
        for token, logprobs in emitted:
            seq.append_token(token, logprobs)
            appended += 1
            reason = seq.check_stop_by_tokens()
            if reason is not None:
                break
        seq.spec_token_ids = []
        # KV is valid for the fed tokens before the proposals and for the proposals kept in the output.
        seq.num_computed_tokens = min(start + item.num_new_tokens - k + min(accepted, appended), seq.num_tokens - 1)
        self.block_manager.commit(seq)
        return reason
