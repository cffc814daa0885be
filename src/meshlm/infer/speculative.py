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

from meshlm.values import is_integer

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
        if not is_integer(k) or k < 1:
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
    followed their latest earlier occurrence are the proposal (nothing when no n in [min, max] matches).

    Each sequence keeps an index of its n-grams (n in [min, max]) by where their latest occurrence ends,
    extended by the tokens added since its last step: a lookup costs a few dictionary reads, not a scan of the
    context. A sequence's tokens only ever grow (a preempted one is recomputed, not changed), so the index
    stays valid until `release`."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.ngram
        self.indexes: dict[int, tuple[int, dict[tuple[int, ...], int]]] = {}  # seq_id -> (indexed up to, index)

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow each sequence (`Sequence`s: their prompt and output tokens)."""
        out = []
        for seq, k in zip(seqs, ks):
            tokens = seq.token_ids
            done, index = self.indexes.get(seq.seq_id, (0, {}))
            self.indexes[seq.seq_id] = self._extend(index, tokens, done)
            out.append(self._continuation(index, tokens, k))
        return out

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids` (no index kept)."""
        index: dict[tuple[int, ...], int] = {}
        self._extend(index, list(token_ids), 0)
        return self._continuation(index, list(token_ids), k)

    def _extend(self, index: dict, tokens: list[int], done: int) -> tuple[int, dict]:
        """Index the n-grams that end (exclusive) at done + 1 .. len - 1: every one a continuation follows."""
        for end in range(done + 1, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(tokens[end - n:end])] = end
        return max(done, len(tokens) - 1), index

    def _continuation(self, index: dict, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = index.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []

    def release(self, seq) -> None:
        self.indexes.pop(seq.seq_id, None)
