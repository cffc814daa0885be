"""Turning one step's logits into each request's next token(s).

Responsible for: greedy, temperature, top-k, top-p and min-p sampling per request, after its logit bias,
penalties and min_tokens mask (`penalize`) and its structured output's mask (the tokens its grammar allows); a
private random generator per seeded request (its samples do not depend on the rest of the batch or on
preemptions); log-probabilities of the sampled token and the top-n alternatives (of the model's
distribution before temperature and filters, as OpenAI reports them); speculative decoding's verification
(`Sampler.emit`, `verify_proposals`): a sequence with k proposals has k + 1 rows of logits, and keeps the
proposals the target accepts and one token of the target's own.
The temperature / top-k / top-p / min-p distribution itself is `meshlm.models.generation.sampling_probs` (drawn by
`sample`), shared with the single-process generator.
Not responsible for: stop conditions (sequence.py, engine.py), proposing tokens or running the model.
"""

from __future__ import annotations

import torch

from meshlm.infer.sequence import SamplingError, SamplingParams, Sequence
from meshlm.infer.structured import allowed, error_of
from meshlm.models.generation import MIN_TEMPERATURE, sample, sampling_probs

__all__ = ["SamplingParams", "Sampler", "sample", "verify_proposals"]

Emitted = list[tuple[int, "dict | None"]]


def accept_greedy(targets: list[int], proposals: list[int]) -> list[int]:
    """Greedy verification: the proposals up to the first that is not the target's argmax, then the target's
    argmax at that position (`targets`: the argmax of each of the k + 1 rows). Exactly the target's tokens."""
    out = []
    for proposal, target in zip(proposals, targets):
        if proposal != target:
            break
        out.append(proposal)
    return out + [targets[len(out)]]


def verify_proposals(probs_nv: torch.Tensor, proposals: list[int], generator: torch.Generator | None,
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): the emitted tokens are distributed as the
    target's own samples, whatever was proposed.

    `probs_nv`: the target's distribution at each proposal's position and after the last, [k + 1, vocab];
    `draft_probs`: the proposer's [k, vocab] (None: each proposal a point mass, as n-gram lookup's). Proposal x
    is accepted with probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw from
    max(0, p - q) normalized (for a point mass: p without x); if all are accepted, one more is drawn from the
    last row."""
    out = []
    for j, x in enumerate(proposals):
        p = probs_nv[j]
        px, qx = float(p[x]), 1.0 if draft_probs is None else float(draft_probs[j, x])
        if float(torch.rand((), generator=generator)) * qx < px:
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min_(0.0)
        if not float(residual.sum()) > 0:  # only by rounding (p(x) >= q(x) everywhere): p itself is exact
            residual = p
        return out + [int(torch.multinomial(residual[None], 1, generator=generator)[0, 0])]
    return out + [int(torch.multinomial(probs_nv[len(proposals)][None], 1, generator=generator)[0, 0])]


class Sampler:
    def __init__(self, *, seed: int = 0):
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator().manual_seed(seed)
        self.prompt_masks: dict[int, torch.Tensor] = {}  # seq_id -> its prompt's tokens (repetition_penalty)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.default_generator
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return gen

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
        self.prompt_masks.pop(seq.seq_id, None)

    def _prompt_mask(self, seq: Sequence, vocab: int) -> torch.Tensor | None:
        """The tokens of `seq`'s prompt, [vocab] bool, built once (a repetition penalty reads them every step)."""
        if seq.params.repetition_penalty == 1:
            return None
        mask = self.prompt_masks.get(seq.seq_id)
        if mask is None:
            mask = self.prompt_masks[seq.seq_id] = prompt_mask(seq, vocab)
        return mask

    def emit(self, logits_nv: torch.Tensor, seqs: list[Sequence],
             proposals: list[list[int]], draft_probs: list | None = None) -> list[Emitted | Exception]:
        """Each sequence's emitted tokens [(token, logprobs or None), ...], or the exception sampling it raised: one
        request's failure is that request's alone (the engine aborts it), never the batch's. Sequence
        i has 1 + len(proposals[i]) consecutive rows of `logits_nv`: it keeps the proposals the target accepts
        and one token of the target's (`verify_proposals`; greedy: `accept_greedy`). `draft_probs[i]`: the
        proposer's distributions [k, vocab] of sequence i's proposals (None: point masses)."""
        sizes = [1 + len(p) for p in proposals]
        assert logits_nv.shape[0] == sum(sizes) and len(seqs) == len(proposals)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        if all(seq.params.plain and seq.params.logprobs is None for seq in seqs):
            # only the token ids leave the device, not [rows, vocab] logits (argmax: the same index in any dtype)
            greedy = logits_nv.argmax(dim=-1).tolist()
            return [[(t, None) for t in accept_greedy(greedy[s:s + n], p)] for s, n, p in zip(starts, sizes, proposals)]
        logits_nv = logits_nv.float().cpu()
        greedy = logits_nv.argmax(dim=-1).tolist()
        results: list[Emitted | Exception] = []
        for i, seq in enumerate(seqs):
            rows = slice(starts[i], starts[i] + sizes[i])
            try:
                if proposals[i]:
                    drafts = draft_probs[i] if draft_probs is not None else None
                    results.append(self._emit_rows(logits_nv[rows], seq, proposals[i], greedy[rows], drafts))
                else:
                    results.append([self._sample_row(logits_nv[rows], seq, greedy[starts[i]])])
            except Exception as e:  # noqa: BLE001 -- reported to the engine, which aborts this request only
                results.append(e)
        return results

    def _sample_row(self, logits_1v: torch.Tensor, seq: Sequence, greedy_token: int) -> tuple[int, dict | None]:
        """One row, no proposals: (token, logprobs or None)."""
        return self._emit_rows(logits_1v, seq, [], [greedy_token], None)[0]

    def _emit_rows(self, logits_nv: torch.Tensor, seq: Sequence, proposals: list[int], greedy: list[int],
                   draft_probs: torch.Tensor | None) -> Emitted:
        p = seq.params
        scores_nv = penalize(logits_nv, seq, proposals, self._prompt_mask(seq, logits_nv.shape[-1])) \
            if p.penalized else logits_nv
        if p.allowed_token_ids is not None and not bool(torch.isfinite(scores_nv).any(dim=-1).all()):
            raise SamplingError("allowed_token_ids", "allowed_token_ids allows only tokens min_tokens holds back "
                                                     "here (EOS or a stop token id)")
        if seq.matcher is not None:  # a structured output: only what its grammar allows next (never speculated)
            assert not proposals
            ok = allowed(seq.matcher, scores_nv.shape[-1])
            if seq.matcher.is_error() or not bool(ok.any()):
                raise SamplingError("structured_outputs", f"structured_outputs allows no token here "
                                                          f"({error_of(seq.matcher)})")
            scores_nv = scores_nv.masked_fill(~ok, float("-inf"))
            if not bool(torch.isfinite(scores_nv).any()):
                held = held_back(seq, len(seq.output_token_ids), ok.numel())
                free = ok.clone()
                free[held] = False  # what the grammar allows that min_tokens does not hold back
                if bool(free.any()):  # then only allowed_token_ids can have left nothing
                    raise SamplingError("allowed_token_ids", "allowed_token_ids and structured_outputs have no "
                                                             "token in common here")
                raise SamplingError("structured_outputs", "structured_outputs allows only tokens min_tokens holds "
                                                          "back here (EOS or a stop token id)")
        if p.temperature < MIN_TEMPERATURE:  # `sample`'s argmax
            tokens = accept_greedy(scores_nv.argmax(dim=-1).tolist() if not p.plain else greedy, proposals)
        else:
            probs = sampling_probs(scores_nv, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
            tokens = verify_proposals(probs, proposals, self._generator(seq), draft_probs)
        if seq.matcher is not None and (not seq.matcher.consume_token(tokens[0]) or seq.matcher.is_error()):
            # a limit of the grammar's parser reached by this token: the request fails, never "stops" complete
            raise SamplingError("structured_outputs", f"structured_outputs failed at token "
                                                      f"{len(seq.output_token_ids) + 1} ({error_of(seq.matcher)})")
        if p.logprobs is None:
            return [(t, None) for t in tokens]
        logprobs_nv = torch.log_softmax(logits_nv[:len(tokens)], dim=-1)
        return list(zip(tokens, logprobs_infos(logprobs_nv, tokens, [p.logprobs] * len(tokens))))


def prompt_mask(seq: Sequence, vocab: int) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.tensor(seq.prompt_token_ids, dtype=torch.long)] = True
    return mask


def held_back(seq: Sequence, generated: int, vocab: int) -> list[int]:
    """The tokens min_tokens holds back after `generated` tokens: EOS and the stop token ids, until min_tokens."""
    if generated >= seq.params.min_tokens:
        return []
    return [t for t in {*seq.eos_token_ids, *seq.params.stop_token_ids} if t < vocab]


def penalize(logits_nv: torch.Tensor, seq: Sequence, proposals: list[int],
             prompt: torch.Tensor | None = None) -> torch.Tensor:
    """The logits a request samples from (`SamplingParams`' penalties, in vLLM's order): only its allowed tokens
    (allowed_token_ids), its logit bias added, then the repetition penalty over the tokens of the prompt
    (`prompt`, a [vocab] mask; built here if not given) and of what it generated, then the frequency and
    presence penalties over what it generated; under
    min_tokens, no EOS or stop token id. Row j follows the tokens generated so far and the first j `proposals`
    (speculative decoding's rows)."""
    p = seq.params
    scores = logits_nv.clone()
    if p.allowed_token_ids is not None:  # vLLM's: the other tokens are out before anything else
        kept = scores[:, p.allowed_token_ids]
        scores.fill_(float("-inf"))
        scores[:, p.allowed_token_ids] = kept
    if p.logit_bias:
        scores[:, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=scores.dtype)
    vocab = scores.shape[-1]
    if p.repetition_penalty != 1 and prompt is None:
        prompt = prompt_mask(seq, vocab)
    for j in range(scores.shape[0]):
        generated = torch.tensor(seq.output_token_ids + proposals[:j], dtype=torch.long)
        if p.repetition_penalty != 1:
            seen = prompt.clone()
            seen[generated] = True
            row = scores[j]
            scores[j] = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                      row * p.repetition_penalty), row)
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(generated, minlength=vocab).to(scores.dtype)
            scores[j] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
        scores[j, held_back(seq, len(generated), vocab)] = float("-inf")
    return scores


def logprobs_infos(logprobs_nv: torch.Tensor, tokens: list[int], num_tops: list[int]) -> list[dict]:
    """Row i's entry: `tokens[i]`'s log-probability and the `num_tops[i]` most likely tokens' (the model's
    distribution), {"token", "logprob", "top"}; the rows' numbers fetched at once (one device sync)."""
    chosen = logprobs_nv.gather(1, torch.tensor(tokens, device=logprobs_nv.device)[:, None])[:, 0].tolist()
    k = min(max(num_tops, default=0), logprobs_nv.shape[-1])
    top = torch.topk(logprobs_nv, k) if k else None
    ids, values = (top.indices.tolist(), top.values.tolist()) if top is not None else ([[]] * len(tokens),) * 2
    return [{"token": t, "logprob": chosen[i], "top": dict(zip(ids[i][:m], values[i][:m]))}
            for i, (t, m) in enumerate(zip(tokens, num_tops))]
