"""Turning one step's logits into each request's next token.

Responsible for: greedy, temperature, top-k and top-p sampling per request; a private random
generator per seeded request (its samples do not depend on the rest of the batch or on
preemptions); log-probabilities of the sampled token and the top-n alternatives (of the model's
distribution before temperature and filters, as OpenAI reports them).
The temperature / top-k / top-p draw itself is `meshlm.models.generation.sample`, shared with the
single-process generator.
Not responsible for: stop conditions (sequence.py, engine.py) or running the model.
"""

from __future__ import annotations

import torch

from meshlm.infer.sequence import SamplingParams, Sequence
from meshlm.models.generation import sample

__all__ = ["SamplingParams", "Sampler", "sample"]


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

    def __call__(self, logits_nv: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict | None] | Exception]:
        """(token, logprobs or None) per row, or the exception sampling that row raised: one request's
        failure is that request's alone (the engine aborts it), never the batch's."""
        assert logits_nv.shape[0] == len(seqs)
        if all(seq.params.greedy and seq.params.logprobs is None for seq in seqs):
            # only the token ids leave the device, not [rows, vocab] logits (argmax: the same index in any dtype)
            return [(token, None) for token in logits_nv.argmax(dim=-1).tolist()]
        logits_nv = logits_nv.float().cpu()
        greedy = logits_nv.argmax(dim=-1).tolist()
        results: list[tuple[int, dict | None] | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                results.append(self._sample_row(logits_nv[row:row + 1], seq, greedy[row]))
            except Exception as e:  # noqa: BLE001 -- reported to the engine, which aborts this request only
                results.append(e)
        return results

    def _sample_row(self, logits_1v: torch.Tensor, seq: Sequence, greedy_token: int) -> tuple[int, dict | None]:
        p = seq.params
        token = greedy_token
        if not p.greedy:
            token = int(sample(logits_1v, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                               generator=self._generator(seq))[0])
        info = None
        if p.logprobs is not None:
            logprobs_v = torch.log_softmax(logits_1v[0], dim=-1)
            top = torch.topk(logprobs_v, min(p.logprobs, logprobs_v.shape[-1])) if p.logprobs else None
            info = {"token": token, "logprob": float(logprobs_v[token]),
                    "top": dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}}
        return token, info
