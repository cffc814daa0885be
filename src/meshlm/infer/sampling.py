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

__all__ = ["SamplingParams", "Sampler", "sample"]


def sample(logits_bv: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row: argmax when temperature is 0, else a draw from the filtered distribution.

    The one implementation of temperature / top-k / top-p, shared by the engine's `Sampler` and the
    single-process `meshlm.generation.generate`.
    """
    if temperature == 0:
        return logits_bv.argmax(dim=-1)
    # Shifted so each row's largest logit is 0: a tiny temperature then gives -inf, never inf - inf = nan.
    logits_bv = (logits_bv - logits_bv.amax(dim=-1, keepdim=True)) / temperature
    if 0 < top_k < logits_bv.shape[-1]:
        kth = torch.topk(logits_bv, top_k, dim=-1).values[:, -1:]
        logits_bv = logits_bv.masked_fill(logits_bv < kth, float("-inf"))
    if top_p < 1:
        sorted_bv, order_bv = torch.sort(logits_bv, dim=-1, descending=True)
        probs_bv = sorted_bv.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop_sorted = probs_bv.cumsum(dim=-1) - probs_bv >= top_p
        logits_bv = logits_bv.masked_fill(drop_sorted.scatter(-1, order_bv, drop_sorted), float("-inf"))
    return torch.multinomial(logits_bv.softmax(dim=-1), 1, generator=generator)[:, 0]


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
                p = seq.params
                tokens[row] = int(sample(logits_nv[row:row + 1], temperature=p.temperature, top_k=p.top_k,
                                         top_p=p.top_p, generator=self._generator(seq))[0])
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
