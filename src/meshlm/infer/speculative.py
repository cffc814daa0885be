"""Speculative decoding's settings and its n-gram (prompt lookup) proposer.

Responsible for: `SpeculativeConfig` (the method, how many tokens to propose, the n-gram sizes, the draft
model), its checks; `NgramProposer`, which proposes the continuation of the latest earlier occurrence of a
sequence's last n tokens (in its prompt or its output, n from the largest size down); and the counters every
method reports (`SpecStats`).
Not responsible for: verifying proposals (sampling.py's `Sampler.emit`, one target forward over the k + 1
positions that `scheduler.py` reserves slots for), running a draft model (draft.py) or the engine loop
(engine.py). No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose `num_speculative_tokens` tokens per decoding sequence and step, verify
    them with one forward of the target over k + 1 positions.

    method "ngram": the tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    n tried from `ngram[1]` down to `ngram[0]`. method "draft": a smaller model with the same tokenizer
    (`model`: a meshlm checkpoint or a Hugging Face directory) proposes them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram: tuple[int, int] = (1, 4)
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer >= 1 (tokens proposed per step)")
        lo, hi = (tuple(self.ngram) + (None, None))[:2]
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi) or len(tuple(self.ngram)) != 2:
            raise ValueError(f"ngram={self.ngram!r} must be (min, max) with 1 <= min <= max")
        object.__setattr__(self, "ngram", (lo, hi))
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs a draft model: give model= (--speculative-model PATH)")
        if self.method == "ngram" and self.model:
            raise ValueError(f"a draft model ({self.model!r}) is given with method 'ngram'; use method 'draft'")

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """None, a `SpeculativeConfig`, or a dict of its fields (`LLM(speculative={...})`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"method", "num_speculative_tokens", "ngram", "model"}
            if unknown:
                raise ValueError(f"speculative has unknown fields {sorted(unknown)}; it takes method, "
                                 "num_speculative_tokens, ngram and model")
            return cls(**value)
        raise ValueError(f"speculative={value!r} must be a SpeculativeConfig, a dict of its fields, or None")

    def check_context(self, max_model_len: int) -> None:
        """ValueError if k proposals could never fit the context (k + 1 positions after at least one token)."""
        if self.num_speculative_tokens + 1 >= max_model_len:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} does not fit the context length "
                             f"{max_model_len}; use at most {max(max_model_len - 2, 0)}")


@dataclass
class SpecStats:
    """What speculation did, summed over steps: tokens proposed and accepted, and per sequence and target
    forward that emitted tokens, how many it emitted."""

    proposed: int = 0  # proposals verified by the target
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens emitted by forwards that sampled (accepted proposals + one from the target each)
    forwards: int = 0  # (sequence, target forward) pairs that emitted tokens

    def as_dict(self, draft_forwards: int = 0) -> dict:
        """The engine's `stats()` entries; `draft_forwards`: batched forwards of the draft model (method "draft")."""
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted,
                "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "spec_draft_forwards": draft_forwards,
                "tokens_per_target_forward": self.emitted / self.forwards if self.forwards else 0.0}


class NgramProposer:
    """Prompt lookup: a sequence's last n tokens searched for in all its earlier tokens; the tokens that
    followed their latest earlier occurrence are the proposal (nothing when no n in [min, max] matches)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.ngram

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow each sequence (`Sequence`s: their prompt and output tokens)."""
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids`."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows that start at i and end before the last token: a continuation follows each
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []

    def release(self, seq) -> None:  # no state per sequence
        pass
