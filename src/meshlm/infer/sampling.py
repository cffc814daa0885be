"""Turning one step's logits into each request's next token.

Responsible for: greedy, temperature, top-k and top-p sampling per request; a private random
generator per seeded request (its samples do not depend on the rest of the batch or on
preemptions); log-probabilities of the sampled token and the top-n alternatives (of the model's
distribution before temperature and filters, as OpenAI reports them).
Not responsible for: stop conditions (sequence.py, engine.py) or running the model.
"""

from __future__ import annotations

import torch

from meshlm.infer.sequence import SamplingParams, Sequence

__all__ = ["SamplingParams", "Sampler"]


class Sampler:
    def __init__(self, *, seed: int = 0):
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator().manual_seed(seed)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.default_generator
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return gen

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)

    def __call__(self, logits_nv: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict | None]]:
        assert logits_nv.shape[0] == len(seqs)
        logits_nv = logits_nv.float().cpu()
        tokens = logits_nv.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = self._sample(logits_nv[row], seq.params, self._generator(seq))
        results = []
        for row, seq in enumerate(seqs):
            n = seq.params.logprobs
            info = None
            if n is not None:
                logprobs_v = torch.log_softmax(logits_nv[row], dim=-1)
                top = torch.topk(logprobs_v, min(n, logprobs_v.shape[-1])) if n else None
                info = {"token": tokens[row], "logprob": float(logprobs_v[tokens[row]]),
                        "top": dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}}
            results.append((tokens[row], info))
        return results

    @staticmethod
    def _sample(logits_v: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        # Shifted so the largest logit is 0 first: a tiny temperature then gives -inf, never inf - inf = nan.
        logits_v = (logits_v - logits_v.max()) / params.temperature
        if 0 < params.top_k < logits_v.shape[-1]:
            kth = torch.topk(logits_v, params.top_k).values[-1]
            logits_v = logits_v.masked_fill(logits_v < kth, float("-inf"))
        probs_v = torch.softmax(logits_v, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs_v.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
            drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
            sorted_p[drop] = 0.0
            probs_v = torch.zeros_like(probs_v).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs_v, 1, generator=gen))
