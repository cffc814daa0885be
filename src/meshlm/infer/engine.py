"""The inference engine: requests in, tokens and text out, one continuous-batching step at a time.

Responsible for: validating requests against the context length and the cache, the step loop
(schedule -> StepInput -> model -> sample/verify -> update -> propose the next step's tokens; proposals only
under speculative decoding, `infer/speculative.py`), incremental detokenization with stop strings,
aborting requests, and the counters the server exports. A failure that belongs to one request (its
sampling, or the model on its tokens alone) finishes that request with finish_reason "error" and the
message in `RequestOutput.error`; the other requests of the step go on with the same tokens.
Not responsible for: threads, HTTP or streaming (server.py), loading models (llm.py), or the policy of
who runs (scheduler.py). Single-threaded: callers serialize access.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from meshlm.infer.block_manager import BlockManager
from meshlm.infer.kv_tiers import TIER_COUNTS, KVTiers
from meshlm.comm import CollectiveError
from meshlm.infer.model_runner import StepInput
from meshlm.infer.parallel import build_runner
from meshlm.infer.sampling import Sampler, logprobs_infos
from meshlm.infer.scheduler import Scheduler, SchedulerOutput
from meshlm.infer.sequence import SamplingError, SamplingParams, Sequence, SequenceStatus
from meshlm.infer.speculative import NgramProposer, SpecStats, SpeculativeConfig
from meshlm.infer.structured import Grammars, grammar_starts
from meshlm.tokenizer import Tokenizer
from meshlm.values import is_integer
from meshlm.models.transformer import Transformer


# Prompt positions whose log-probabilities are computed at a time (`Engine._keep_prompt_logprobs`).
PROMPT_LOGPROB_ROWS = 1024


@dataclass
class RequestOutput:
    """A request's state after a step. `new_token_ids` / `new_text` are what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict] | None = None
    # params.prompt_logprobs: each prompt token's entry ({"token", "logprob", "top"}), None for the first
    prompt_logprobs: list[dict | None] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_cached_tokens: int = 0
    error: str | None = None  # why the request failed (finish_reason "error")
    error_field: str | None = None  # the request's own parameter that failed it (a SamplingError's), else None
    retrieved: list[dict] | None = None  # passages put before the prompt (retrieval-augmented requests)


@dataclass
class _Detok:
    """Incremental detokenization: each step decodes a few tokens, never the whole output again.

    Tokens [prefix_offset, read_offset) were decoded already and are decoded again only as context for
    the next piece (a tokenizer may render a token differently at the start of a text, e.g. a leading
    space); the new piece is what decoding from prefix_offset adds to them. A piece that ends in an
    incomplete UTF-8 character waits for the next token.
    """

    text: str = ""  # text of the generated tokens, cut at a stop string
    emitted: int = 0  # characters already returned as new_text
    num_tokens: int = 0  # generated tokens already returned
    prefix_offset: int = 0
    read_offset: int = 0
    stopped: bool = False  # a stop string cut `text`: nothing more is appended
    searched: int = 0  # characters of `text` already searched for params.structured_after


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, *, block_size: int = 32,
                 num_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 eos_token_ids: tuple[int, ...] | None = None, seed: int = 0, runner=None,
                 native_attention: bool = True, speculative=None, draft_model: Transformer | None = None,
                 kv_host_mb: float | None = None, kv_disk_dir: str | None = None, kv_disk_mb: float | None = None):
        """`runner`: what runs each step on the model (default: `infer.parallel.build_runner`'s one-rank
        `ModelRunner` over `model` with the KV cache arguments and `native_attention`);
        `infer.parallel.ParallelRunner` runs it on several ranks. `speculative`: a
        `infer.speculative.SpeculativeConfig` (or a dict of its fields) to decode speculatively; method "draft"
        proposes with `draft_model` (loaded by the caller: `LLM` reads the config's path), on this process
        with a paged cache of its own. `kv_host_mb`, `kv_disk_dir`, `kv_disk_mb`: KV tiers below the cache, per rank
        (`infer/kv_tiers.py`; a given `runner` has its own, made by `build_runner`)."""
        self.model = model
        self.tokenizer = tokenizer
        longest = model.config.max_seq_len
        if max_model_len is not None and not 0 <= max_model_len <= longest:
            raise ValueError(f"max_model_len={max_model_len} (--max-model-len) must be in 1..{longest}, the model's "
                             "context (0 or unset: all of it); the model was not made for positions beyond it")
        self.max_model_len = max_model_len or longest
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
        self.eos_token_ids = tuple(eos_token_ids)
        self.runner = runner or build_runner(model, block_size=block_size, num_blocks=num_blocks,
                                             kv_cache_memory_bytes=kv_cache_memory_bytes,
                                             native_attention=native_attention, kv_host_mb=kv_host_mb,
                                             kv_disk_dir=kv_disk_dir, kv_disk_mb=kv_disk_mb)
        num_groups = getattr(self.runner, "num_groups", 1)
        store = getattr(self.runner, "tier_store", None)
        self.tiers = None if store is None or not enable_prefix_caching else KVTiers(
            host_slots=store.host_slots, disk_blocks=store.disk_blocks, num_groups=num_groups,
            disk_index=store.disk_index())
        self.block_manager = BlockManager(num_blocks=self.runner.num_blocks, block_size=self.runner.block_size,
                                          num_groups=num_groups, enable_prefix_caching=enable_prefix_caching,
                                          tiers=self.tiers)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_chunked_prefill=enable_chunked_prefill)
        self.sampler = Sampler(seed=seed)
        self.grammars = Grammars(tokenizer, self.model.config.vocab_size, self.eos_token_ids)  # structured outputs
        self.speculative = SpeculativeConfig.of(speculative)
        self.proposer = self._proposer(draft_model, seed=seed)
        self.spec_stats = SpecStats()
        self.requests: dict[str, Sequence] = {}
        self._detok: dict[str, _Detok] = {}
        self._next_id = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        # Where a step's time goes (seconds, summed over steps): scheduling + the step's plain input +
        # the scheduler's update ("schedule"), the model ("model"; of it, attention: runner.attention_seconds),
        # sampling, and blocks brought back from the KV tiers before scheduling ("kv_tiers"). Detokenization and
        # stop strings are what is left of a step.
        self.seconds = {"schedule": 0.0, "model": 0.0, "sampling": 0.0, "kv_tiers": 0.0}
        self.finish_reasons: Counter[str] = Counter()  # "stop" | "length" | "abort" | "error" -> requests

    def _proposer(self, draft_model: Transformer | None, *, seed: int):
        spec = self.speculative
        if spec is None:
            if draft_model is not None:
                raise ValueError("a draft model is given without speculative=SpeculativeConfig(method='draft', ...)")
            return None
        spec.check_context(self.max_model_len)
        if spec.method == "ngram":
            return NgramProposer(spec)
        if draft_model is None:
            raise ValueError(f"speculative method 'draft' needs the draft model {spec.model!r} loaded: pass "
                             "draft_model= (LLM loads it from the config's path)")
        from meshlm.infer.draft import DraftProposer

        # as many blocks as the model's cache, and room for every running sequence's proposals
        bm, k = self.block_manager, spec.num_speculative_tokens
        return DraftProposer(draft_model, self.model, spec, block_size=bm.block_size, seed=seed,
                             num_blocks=bm.num_blocks + self.scheduler.max_num_seqs * (bm.blocks_needed(k) + 1))

    # ---- requests ------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (tokenizer.json): give prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        try:
            ids = list(prompt)
        except TypeError:
            raise ValueError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}") from None
        bad = [t for t in ids if not is_integer(t)]
        if bad:
            raise ValueError(f"a prompt is text or a list of token ids (integers); it holds {bad[0]!r} "
                             f"({type(bad[0]).__name__})")
        ids = [int(t) for t in ids]
        bad = self._outside_vocabulary(ids)
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.model.config.vocab_size})")
        return ids

    def _outside_vocabulary(self, ids: list[int]) -> list[int]:
        """The ids of `ids` that name no token of the model."""
        return [t for t in ids if not 0 <= t < self.model.config.vocab_size]

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                      request_id: str | None = None, hold: int | None = None) -> Sequence:
        """Tokenize and validate a request without touching the engine's state (safe from any thread). `hold`: the
        most tokens a sequence may hold where an unset max_tokens runs to the context (default: what this engine's
        cache holds of one; a disaggregated pair gives the lesser of its two engines')."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context length is {self.max_model_len}; "
                             "shorten the prompt")
        if params.max_tokens is None:  # up to the context (OpenAI chat's default), as far as the cache holds it
            longest = min(self.max_model_len, hold or self.scheduler.most_tokens_per_sequence())
            room = longest - len(ids)
            if room < 1:
                raise ValueError(f"the prompt has {len(ids)} tokens and leaves no room to generate in the {longest} "
                                 "tokens a sequence can hold here; shorten the prompt")
            params = dataclasses.replace(params, max_tokens=room)
        for name, named in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or {})),
                            ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = self._outside_vocabulary(named)
            if bad:
                raise SamplingError(name, f"{name} {bad[:5]} are outside the vocabulary "
                                          f"[0, {self.model.config.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                             f"length {self.max_model_len}; lower max_tokens to at most {self.max_model_len - len(ids)}")
        k = params.num_speculative_tokens
        if k is not None and (self.speculative is None or k > self.speculative.num_speculative_tokens):
            most = "speculates on no token (start it with speculative=...)" if self.speculative is None else \
                f"proposes at most {self.speculative.num_speculative_tokens} tokens a step"
            raise SamplingError("num_speculative_tokens",
                                f"num_speculative_tokens={k} is more than this engine allows: it {most}")
        matcher = self.grammars.matcher(params.structured_outputs) if params.structured_outputs is not None else None
        waits = params.structured_after is not None
        seq = Sequence(ids, params, request_id=request_id or "", eos_token_ids=self.eos_token_ids,
                       max_model_len=self.max_model_len, matcher=None if waits else matcher,
                       waiting_matcher=matcher if waits else None)
        self.scheduler.check(seq)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq
        self._detok[seq.request_id] = _Detok()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None) -> Sequence:
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        seq = self.make_sequence(prompt, params, request_id=request_id)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self.sampler.release(seq)
            if self.proposer is not None:
                self.proposer.release(seq)
            self._detok.pop(request_id, None)
            self.finish_reasons["abort"] += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- requests moving between engines (disaggregated prefill and decode, infer/disaggregated.py) ---------

    def hand_off(self, request_id: str) -> tuple[Sequence, Sequence, tuple]:
        """Take a running request out of this engine to continue in another: (its sequence here, which still
        holds its blocks until `block_manager.free` -- their KV is to be copied first; a copy of it without
        blocks for the other engine; its text and random state, for the other engine's `take_over`)."""
        seq = self.requests.pop(request_id)
        self.scheduler.detach(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        moved = dataclasses.replace(seq, block_table=[], num_computed_tokens=0, status=SequenceStatus.WAITING,
                                    output_token_ids=list(seq.output_token_ids),
                                    output_logprobs=list(seq.output_logprobs))
        return seq, moved, (self._detok.pop(request_id), self.sampler.generators.pop(seq.seq_id, None))

    def take_over(self, seq: Sequence, state: tuple, num_computed: int) -> int | None:
        """Continue a request another engine `hand_off`ed, its first `num_computed` tokens' KV computed there
        (`Scheduler.adopt`): how many of them this engine's prefix cache holds (the others' KV must be written
        into `seq.block_table` before the next step), or None when there is no room yet (nothing changed)."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        cached = self.scheduler.adopt(seq, num_computed)
        if cached is None:
            return None
        self.requests[seq.request_id] = seq
        self._detok[seq.request_id], generator = state
        if generator is not None:
            self.sampler.generators[seq.seq_id] = generator
        return cached

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that produced tokens or finished in it."""
        self._fetch_from_tiers()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        failed: dict[Sequence, Exception] = {}
        try:
            # the blocks the scheduler evicted are copied to the tiers before the step writes into them
            moves = self.tiers.take_moves() if self.tiers is not None else []
            step = StepInput.from_schedule(out, self.runner.block_size, kv_moves=moves)
            t1 = time.perf_counter()
            self.seconds["schedule"] += t1 - t0
            logits = self._keep_prompt_logprobs(self.runner.execute(step), step, out)
            t0 = time.perf_counter()
            self.seconds["model"] += t0 - t1
            rows = [item for item in out.scheduled if item.samples]
        except CollectiveError:  # a rank of a parallel runner is gone: no sequence of this step can run
            raise
        except Exception:  # noqa: BLE001 -- find whose tokens fail; the others must not pay for them
            logits, rows = self._execute_one_by_one(out, failed)
        t0 = time.perf_counter()
        sampled = self._sample(logits, rows, failed)
        t1 = time.perf_counter()
        self.seconds["sampling"] += t1 - t0
        if failed:
            out.scheduled = [item for item in out.scheduled if item.seq not in failed]
        sampling = [item.seq for item in rows if item.seq.seq_id in sampled]
        before = sum(len(seq.output_token_ids) for seq in sampling)
        self.scheduler.update(out, sampled)
        self.seconds["schedule"] += time.perf_counter() - t1
        self.num_steps += 1
        self.num_generated_tokens += sum(len(seq.output_token_ids) for seq in sampling) - before
        outputs = self._outputs(sampling, failed)
        t0 = time.perf_counter()
        # The next step's proposals, in this step: a sequence that has just sampled its first token gets its
        # first proposals here, the draft model prefilling its prompt in the step that prefilled the target's
        # (as vLLM's drafter runs in the step it drafts after), not in the first gap between tokens.
        self._propose()
        self.seconds["schedule"] += time.perf_counter() - t0
        return outputs

    def _fetch_from_tiers(self) -> None:
        """Bring back from the KV tiers the prefix blocks of the waiting requests this step may admit, before the
        scheduler matches prefixes; a load that failed on any rank (a disk file that did not check out) leaves
        its tokens to be recomputed. A write that failed on this rank (a full disk) turns the disk tier off."""
        if self.tiers is None:
            return
        t0 = time.perf_counter()
        sched = self.scheduler
        room = max(sched.max_num_seqs - len(sched.running), 0)
        self.block_manager.fetch(list(itertools.islice(sched.waiting, room)))
        moves = self.tiers.take_moves()
        if moves:
            failed = self.runner.move_kv(moves)
            self.block_manager.loads_failed([moves[i][2] for i in failed])
        if self.tiers.has_disk and not self.runner.tier_store.disk_ok:
            self.tiers.disable_disk()
        self.seconds["kv_tiers"] += time.perf_counter() - t0

    def _propose(self) -> None:
        """Speculative decoding: proposals for every running sequence that decodes next (none for the others, for
        a structured output's, whose grammar decides each token or will once its text is reached, or before
        min_tokens, where a step crossing it could find a stop string one token a step would not look for),
        which the next step verifies; a sequence the scheduler then preempts or gives no room drops them."""
        if self.proposer is None:
            return
        decoding, ks = [], []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            k = min(seq.params.num_speculative_tokens or self.speculative.num_speculative_tokens,
                    seq.max_total_tokens - seq.num_tokens - 1)
            if seq.num_computed_tokens == seq.num_tokens - 1 and k > 0 and seq.matcher is None \
                    and seq.waiting_matcher is None and len(seq.output_token_ids) >= seq.params.min_tokens:
                decoding.append(seq)
                ks.append(k)
        if decoding:
            for seq, tokens in zip(decoding, self.proposer.propose(decoding, ks)):
                seq.spec_token_ids = list(tokens)

    def _sample(self, logits, rows: list, failed: dict[Sequence, Exception]) -> dict[int, list]:
        """Each sampling sequence's emitted tokens (`Sampler.emit`), by seq_id; failures go to `failed`."""
        if not rows:
            return {}
        seqs = [item.seq for item in rows]
        proposals = [seq.spec_token_ids for seq in seqs]
        drafts = getattr(self.proposer, "draft_probs", None)
        if drafts is not None:  # the draft's distributions of what it proposed (None: greedy, or no proposals)
            drafts = [drafts(seq) if seq.spec_token_ids else None for seq in seqs]
            drafts = [None if d is None else d[:len(seq.spec_token_ids)] for seq, d in zip(seqs, drafts)]
        sampled = {}
        for seq, props, result in zip(seqs, proposals, self.sampler.emit(logits, seqs, proposals, drafts)):
            if isinstance(result, Exception):
                failed[seq] = result
                continue
            sampled[seq.seq_id] = result
            stats = self.spec_stats
            stats.proposed += len(props)
            stats.accepted += len(result) - 1
            stats.emitted += len(result)
            stats.forwards += 1
        return sampled

    def _outputs(self, sampling: list[Sequence], failed: dict[Sequence, Exception]) -> list[RequestOutput]:
        now = time.monotonic()
        results = []
        for seq in sampling:
            # Also for a sequence that just finished by length or a stop token: its text must include
            # that last token, and a stop string it completes still cuts the text.
            self._check_stop_strings(seq)
            state = self._detok[seq.request_id]
            if seq.waiting_matcher is not None and not seq.is_finished:  # a grammar waiting for its text
                error = grammar_starts(seq, state.text, state.searched, self.tokenizer.encode)
                state.searched = len(state.text)
                if error is not None:
                    failed[seq] = error
                    continue
            if seq.is_finished:
                seq.finish_time = now
            results.append(self._output(seq))
            if seq.is_finished:
                self._forget(seq)
        for seq, error in failed.items():
            self.scheduler.finish(seq, "error")
            seq.finish_time = now
            result = self._output(seq)
            result.error = f"{type(error).__name__}: {error}"
            result.error_field = getattr(error, "field", None)
            results.append(result)
            self._forget(seq)
        return results

    def _forget(self, seq: Sequence) -> None:
        self.finish_reasons[seq.finish_reason or "stop"] += 1
        self.requests.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self.sampler.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _execute_one_by_one(self, out: SchedulerOutput, failed: dict[Sequence, Exception]):
        """Re-run a failed step one sequence at a time; the sequences that fail alone go to `failed`.

        Safe to repeat: each sequence writes only its own KV slots, with the same values as before.
        """
        rows, parts = [], []
        for item in out.scheduled:
            try:
                alone = StepInput.from_schedule(SchedulerOutput([item]), self.runner.block_size)
                logits = self._keep_prompt_logprobs(self.runner.execute(alone), alone, SchedulerOutput([item]))
            except Exception as e:  # noqa: BLE001 -- this request's own failure
                failed[item.seq] = e
                continue
            if item.samples:
                rows.append(item)
                parts.append(logits)
        return (torch.cat(parts) if parts else None), rows

    def _keep_prompt_logprobs(self, logits: torch.Tensor, step: StepInput, out: SchedulerOutput) -> torch.Tensor:
        """Record the log-probabilities of the prompt tokens whose positions' logits the step computed after its
        sampling rows (`StepInput.prompt_positions`); return the sampling rows."""
        n = step.num_sampling_rows
        if not step.prompt_positions:
            return logits
        by_id = {item.seq.seq_id: item.seq for item in out.scheduled}
        wanted = [(by_id[seq_id], pos) for seq_id, pos in step.prompt_positions]
        # PROMPT_LOGPROB_ROWS rows at a time: a long prompt's [rows, vocab] in fp32 would be gigabytes
        for first in range(0, len(wanted), PROMPT_LOGPROB_ROWS):
            part = wanted[first:first + PROMPT_LOGPROB_ROWS]
            logprobs = torch.log_softmax(logits[n + first:n + first + len(part)].float(), dim=-1)
            entries = logprobs_infos(logprobs, [seq.prompt_token_ids[pos + 1] for seq, pos in part],
                                     [seq.params.prompt_logprobs for seq, _ in part])
            for (seq, pos), entry in zip(part, entries):
                seq.prompt_logprobs[pos + 1] = entry
        return logits[:n]

    def _advance_text(self, seq: Sequence) -> None:
        state = self._detok[seq.request_id]
        if self.tokenizer is None or state.stopped:
            return
        ids = seq.output_token_ids
        prefix = self.tokenizer.decode(ids[state.prefix_offset:state.read_offset])
        full = self.tokenizer.decode(ids[state.prefix_offset:])
        if len(full) > len(prefix) and (seq.is_finished or not full.endswith("\ufffd")):
            state.text += full[len(prefix):]
            state.prefix_offset, state.read_offset = state.read_offset, len(ids)

    def _check_stop_strings(self, seq: Sequence) -> None:
        state = self._detok[seq.request_id]
        before, offsets = len(state.text), (state.prefix_offset, state.read_offset)
        self._advance_text(seq)
        stops = seq.params.stop
        if not stops or self.tokenizer is None or state.stopped or len(state.text) == before \
                or len(seq.output_token_ids) < seq.params.min_tokens:  # (vLLM's min_tokens: no stop before)
            return
        # Only the new piece, and the characters before it a stop string could start in, can hold a match.
        start = max(0, before - max(map(len, stops)) + 1)
        hits = [(i, i + len(s)) for i, s in ((state.text.find(s, start), s) for s in stops) if i >= 0]
        if hits:
            cut = min(hits)
            self._drop_tokens_past(seq, state.text[:before], offsets, cut[1])
            state.text = state.text[:cut[1] if seq.params.include_stop_str_in_output else cut[0]]
            state.stopped = True
            if seq.is_finished:
                seq.finish_reason = "stop"
            else:
                self.scheduler.finish(seq, "stop")

    def _drop_tokens_past(self, seq: Sequence, text: str, offsets: tuple[int, int], end: int) -> None:
        """A step that emitted several tokens (speculative decoding) keeps only those up to the one that completes
        the text's first `end` characters (a stop string), as decoding one token a step would have stopped."""
        state = self._detok[seq.request_id]
        ids = seq.output_token_ids
        prefix_offset, read_offset = offsets
        prefix = self.tokenizer.decode(ids[prefix_offset:read_offset])
        for keep in range(state.num_tokens + 1, len(ids)):
            if len(text) + len(self.tokenizer.decode(ids[prefix_offset:keep])) - len(prefix) >= end:
                del ids[keep:]
                del seq.output_logprobs[keep:]
                return

    def _output(self, seq: Sequence) -> RequestOutput:
        state = self._detok[seq.request_id]
        text = state.text
        # Hold back what may still change: the start of a stop string.
        emit_upto = len(text)
        if not seq.is_finished and seq.params.stop:
            emit_upto = min(emit_upto, len(text) - max(map(len, seq.params.stop)) + 1)
        emit_upto = max(emit_upto, state.emitted)
        new_text, state.emitted = text[state.emitted:emit_upto], emit_upto
        new_ids = seq.output_token_ids[state.num_tokens:]
        state.num_tokens = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=list(seq.output_token_ids),
            text=text, finished=seq.is_finished, finish_reason=seq.finish_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            new_token_ids=new_ids, new_text=new_text, num_cached_tokens=seq.num_cached_tokens)

    # ---- offline use ---------------------------------------------------------------------------

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run `prompts` to completion through continuous batching; results in prompt order."""
        return run_to_completion(self, prompts, params)

    def stats(self) -> dict:
        bm = self.block_manager
        mesh = getattr(self.runner, "mesh", None)
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks, "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_total": bm.num_blocks, "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_queried_tokens": bm.num_queried_tokens, "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "generated_tokens": self.num_generated_tokens, "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps, "finish_reasons": dict(self.finish_reasons),
            # speculative decoding (zeros without it; tokens_per_target_forward is 1.0 then, once tokens came)
            "speculative": self.speculative.method if self.speculative is not None else None,
            **self.spec_stats.as_dict(getattr(self.proposer, "num_forwards", 0)),
            # several ranks: the blocks each cp rank holds (tp ranks hold the same blocks, each its heads),
            # and what every mesh axis moved (rank 0's view)
            "kv_blocks_used_per_rank": bm.used_blocks_per_group(),
            "kv_blocks_free_per_rank": [len(f) for f in bm.free_lists],
            **self._tier_stats(),
            "comm": {axis: {"calls": o.calls, "bytes": o.bytes, "seconds": o.seconds}
                     for axis, o in (mesh.stats.by_axis().items() if mesh is not None else ())},
            "comm_calls_per_token": {axis: o.calls / max(self.num_generated_tokens, 1)
                                     for axis, o in (mesh.stats.by_axis().items() if mesh is not None else ())},
        }

    def _tier_stats(self) -> dict:
        """The KV tiers' counters (zeros without tiers): prompt tokens found per tier (the device pool's are the
        rest of `prefix_cache_hit_tokens`), prompt tokens computed (found in no tier), blocks held and moved."""
        bm, tiers = self.block_manager, self.tiers
        counts = tiers.counts if tiers is not None else {}
        host_hits, disk_hits = bm.tier_hit_tokens["host"], bm.tier_hit_tokens["disk"]
        return {
            "kv_host_hit_tokens": host_hits, "kv_disk_hit_tokens": disk_hits,
            "kv_device_hit_tokens": bm.num_hit_tokens - host_hits - disk_hits,
            "kv_recomputed_tokens": bm.num_queried_tokens - bm.num_hit_tokens,
            "kv_host_blocks": tiers.num_blocks("host") if tiers is not None else 0,
            "kv_host_blocks_total": tiers.host_slots * tiers.num_groups if tiers is not None else 0,
            "kv_disk_blocks": tiers.num_blocks("disk") if tiers is not None else 0,
            "kv_disk_blocks_total": tiers.disk_blocks * tiers.num_groups if tiers is not None else 0,
            **{f"kv_{k}": counts.get(k, 0) for k in TIER_COUNTS},
        }


def run_to_completion(engine, prompts: list[str | list[int]],
                      params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    """`Engine.generate` on anything with its add_request, abort and step (`infer/disaggregated.py`'s engine too)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
    wrong = [type(sp).__name__ for sp in params_list if not isinstance(sp, SamplingParams)]
    if wrong:
        raise ValueError(f"params must be SamplingParams (or a list of them, one per prompt), not {wrong[0]}")
    ids: list[str] = []
    try:
        for prompt, sp in zip(prompts, params_list):
            ids.append(engine.add_request(prompt, sp).request_id)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for result in engine.step():
                if result.finished:
                    final[result.request_id] = result
    except BaseException:  # all or nothing, whatever went wrong (a bad prompt, an interrupt): the engine stays usable
        for request_id in ids:
            engine.abort(request_id)
        raise
    return [final[i] for i in ids]
