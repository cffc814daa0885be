"""Speculative decoding's draft model: a smaller model with the target's tokenizer proposes k tokens a step.

Responsible for: `DraftProposer`, run by the engine on rank 0 before each step. It keeps, per target sequence,
a shadow `Sequence` in a paged KV cache of its own (its own `ModelRunner` and `BlockManager`, the engine's code
for both), brings the shadow up to the target's tokens (its cache stays valid up to the first token that
differs -- accepted proposals are not recomputed, rejected ones are overwritten), then runs k batched forwards
of every proposing sequence at once, drawing each proposal from the draft's distribution under the request's
own temperature / top-k / top-p (greedy requests: the argmax, verified greedily). Those distributions
(`draft_probs`) are what verification's rejection rule divides by.
Not responsible for: verifying (sampling.py), loading the draft or checking its tokenizer (llm.py), scheduling
the target (scheduler.py).
"""

from __future__ import annotations

import torch

from meshlm.infer.block_manager import BlockManager
from meshlm.infer.model_runner import ModelRunner, StepInput
from meshlm.infer.scheduler import ScheduledSequence, SchedulerOutput
from meshlm.infer.sequence import Sequence
from meshlm.infer.speculative import SpeculativeConfig
from meshlm.models.generation import MIN_TEMPERATURE, sampling_probs
from meshlm.models.transformer import Transformer


class DraftProposer:
    def __init__(self, draft: Transformer, target: Transformer, config: SpeculativeConfig, *, block_size: int,
                 num_blocks: int, seed: int = 0):
        """`num_blocks` of `block_size` tokens in the draft's own cache (the engine gives it as many as the
        target's, and room for every sequence's k proposals)."""
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the model's "
                             f"({target.config.vocab_size}); give a draft model with the model's tokenizer")
        self.config = config
        self.runner = ModelRunner(draft, block_size=block_size, num_blocks=num_blocks)
        self.block_manager = BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
        self.max_len = draft.config.max_seq_len
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> the draft's copy of its tokens and cache
        self.probs: dict[int, torch.Tensor] = {}  # target seq_id -> [k, vocab] of the last proposals
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator().manual_seed(seed)
        self.num_forwards = 0

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)
        self.probs.pop(seq.seq_id, None)
        self.generators.pop(seq.seq_id, None)

    def draft_probs(self, seq: Sequence) -> torch.Tensor | None:
        """The distributions [k, vocab] the last proposals were drawn from (None for a greedy request)."""
        return self.probs[seq.seq_id]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow each sequence: k batched forwards of the draft (the first also catches
        each shadow up with its sequence's new tokens)."""
        live = [(seq, k) for seq, k in zip(seqs, ks) if self._sync(seq, k)]
        tokens: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _ in live}
        for r in range(max((k for _, k in live), default=0)):
            batch = [seq for seq, k in live if k > r]
            shadows = [self.shadows[seq.seq_id] for seq in batch]
            out = SchedulerOutput([ScheduledSequence(s, s.num_tokens - s.num_computed_tokens) for s in shadows])
            logits = self.runner.execute(StepInput.from_schedule(out, self.runner.block_size))
            self.num_forwards += 1
            greedy = logits.argmax(dim=-1).tolist()
            logits = logits.float().cpu() if any(seq.params.temperature >= MIN_TEMPERATURE for seq in batch) else None
            for row, (seq, shadow) in enumerate(zip(batch, shadows)):
                shadow.num_computed_tokens = shadow.num_tokens
                if seq.params.temperature < MIN_TEMPERATURE:  # verified greedily: no distribution needed
                    token = greedy[row]
                else:
                    token, p = self._draw(logits[row:row + 1], seq)
                    probs[seq.seq_id].append(p)
                shadow.prompt_token_ids.append(token)
                tokens[seq.seq_id].append(token)
        for seq_id, rows in probs.items():
            self.probs[seq_id] = torch.cat(rows) if rows else None
        return [tokens[seq.seq_id] for seq in seqs]

    def _sync(self, seq: Sequence, k: int) -> bool:
        """Make the shadow hold the sequence's tokens, its cache valid up to the first token that differs, and
        slots for the k - 1 proposals it feeds back; False (no proposals) where the draft has no room."""
        target = seq.token_ids
        if len(target) + k > self.max_len:
            return False
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(list(target))
            self.block_manager.match_prefix(shadow)  # no prefix caching: registers the sequence, no hit
        valid = min(shadow.num_computed_tokens, len(target) - 1)
        old = shadow.prompt_token_ids
        for i in range(valid):
            if old[i] != target[i]:
                valid = i
                break
        shadow.prompt_token_ids = list(target)
        shadow.num_computed_tokens = valid
        self.block_manager.trim(shadow, len(target))
        if not self.block_manager.ensure_slots(shadow, len(target) + k - 1):
            self.release(seq)  # its cache is given up; rebuilt from the prompt when there is room again
            return False
        return True

    def _draw(self, logits_1v: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor]:
        """A proposal of a sampling request and the distribution it was drawn from, [1, vocab]."""
        p = seq.params
        probs = sampling_probs(logits_1v, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
        gen = self.default_generator
        if p.seed is not None:
            gen = self.generators.get(seq.seq_id)
            if gen is None:
                gen = self.generators[seq.seq_id] = torch.Generator().manual_seed(p.seed)
        return int(torch.multinomial(probs, 1, generator=gen)[0, 0]), probs
