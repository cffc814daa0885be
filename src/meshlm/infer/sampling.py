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


# Below this temperature the distribution is argmax up to float32 rounding: dividing by it would
# overflow (or, as a float32 scalar, divide by zero) and give nan, so it is sampled greedily.
MIN_TEMPERATURE = 1e-5


def sample(logits_bv: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row: argmax when temperature is (nearly) 0, else a draw from the filtered distribution.

    The one implementation of temperature / top-k / top-p, shared by the engine's `Sampler` and the
    single-process `meshlm.generation.generate`. Numerically safe for every temperature >= 0 and top_p
    in (0, 1]: the most likely token always stays a candidate, so no row is ever all -inf.
    """
    if temperature < MIN_TEMPERATURE:
        return logits_bv.argmax(dim=-1)
    logits_bv = raw_bv = logits_bv.float()
    # Shifted so each row's largest logit is 0, then scaled by 1/temperature clamped to float32's range:
    # -inf logits stay -inf, finite ones stay finite (a huge temperature is a uniform draw, not inf/inf).
    logits_bv = logits_bv - logits_bv.amax(dim=-1, keepdim=True)
    logits_bv = logits_bv * min(1.0 / temperature, 1.0 / MIN_TEMPERATURE)
    if 0 < top_k < logits_bv.shape[-1]:
        kth = torch.topk(logits_bv, top_k, dim=-1).values[:, -1:]
        logits_bv = logits_bv.masked_fill(logits_bv < kth, float("-inf"))
    if top_p < 1:
        sorted_bv, order_bv = torch.sort(logits_bv, dim=-1, descending=True)
        probs_bv = sorted_bv.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included); the top
        # token always stays (a top_p that rounds to 0 in float32 would otherwise drop every token).
        drop_sorted = probs_bv.cumsum(dim=-1) - probs_bv >= top_p
        drop_sorted[:, 0] = False
        logits_bv = logits_bv.masked_fill(drop_sorted.scatter(-1, order_bv, drop_sorted), float("-inf"))
    probs_bv = logits_bv.softmax(dim=-1)
    # Rows the model itself made non-finite (nan logits) fall back to argmax rather than failing the step.
    bad = ~torch.isfinite(probs_bv).all(dim=-1)
    if bool(bad.any()):
        probs_bv[bad] = torch.nn.functional.one_hot(torch.nan_to_num(raw_bv[bad], nan=float("-inf")).argmax(-1),
                                                    probs_bv.shape[-1]).float()
    return torch.multinomial(probs_bv, 1, generator=generator)[:, 0]


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
