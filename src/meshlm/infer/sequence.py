"""Request state of the inference engine: sampling parameters and one `Sequence` per request.

Responsible for: validating the user's sampling parameters, and holding what the scheduler and
the block manager need about a request (prompt and generated token ids, status, block table, how
many tokens already have their keys/values in the cache).
Not responsible for: deciding what runs (scheduler.py), owning KV blocks (block_manager.py),
sampling itself (sampling.py) or text (the engine detokenizes). No torch import here.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from meshlm.values import is_finite_real, is_integer, is_whole_number


class SamplingError(ValueError):
    """A sampling parameter out of its range; `field` names it (the server answers with the request's own name for
    it, e.g. max_completion_tokens)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """How to generate one request's tokens.

    temperature 0 means greedy. top_k <= 0, top_p == 1 and min_p == 0 disable those filters (min_p, vLLM's:
    tokens less likely than min_p x the most likely one's probability are dropped). `seed` gives the
    request its own random generator, so its samples do not depend on what else is in the batch.
    `stop` strings end the text (the stop string itself is not returned, unless `include_stop_str_in_output`,
    vLLM's); `stop_token_ids` end it
    with that token included in `token_ids`. `logprobs` = n returns the log-probability of each
    sampled token and of the n most likely tokens at that step. `num_speculative_tokens`: at most this many
    tokens proposed per step for this request (an engine started with speculative decoding; None: the
    engine's number). `max_tokens` None: up to the context length (what the engine's cache can hold of it), the
    OpenAI chat API's default. `prompt_logprobs` = n returns, for every prompt token but the first, its
    log-probability given the tokens before it and the n most likely tokens there (vLLM's parameter; the whole
    prompt is computed, whatever the prefix cache holds of it).

    Penalties, as vLLM applies them, in this order, before temperature and the filters: `logit_bias` {token id:
    bias in [-100, 100]} is added to the logits (OpenAI's); `repetition_penalty` (> 0; 1 is off) divides the
    positive logits of every token in the prompt or generated so far and multiplies the negative ones (CTRL's,
    transformers'); `frequency_penalty` and `presence_penalty` (in [-2, 2]; OpenAI's) subtract, from each token's
    logit, the penalty times how often it was generated so far, and the penalty once if it was. Logprobs stay
    the model's own. `min_tokens` (vLLM's): until that many tokens are generated, neither EOS nor a stop token
    id is sampled and stop strings are not looked for. `allowed_token_ids` (vLLM's): only these tokens are
    sampled (a mask before the others).

    `structured_outputs` (`infer.structured.StructuredOutputs`, or a dict of its fields: json, regex, choice,
    grammar, json_object) holds the tokens to a JSON schema, a regular expression, a list of choices or a Lark
    grammar: only the tokens it allows next are sampled, and the request stops when it is complete.
    `structured_after` (a text, e.g. a reasoning model's "</think>"): the grammar holds the tokens only after the
    generated text holds it -- the thinking before it is free, as vLLM applies structured outputs after a reasoning
    parser's end of thinking.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: object = None  # a StructuredOutputs once checked
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    structured_after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (isinstance(self.stop, (list, tuple))
                                          and all(isinstance(x, str) for x in self.stop)):
            raise SamplingError("stop", f"stop={self.stop!r} must be a string or a list of strings")
        self.stop = list(self.stop or [])
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            # finite numbers (a bool is not one); their ranges below
            value = getattr(self, name)
            if not is_finite_real(value):
                raise SamplingError(name, f"{name}={value!r} must be a finite number")
            setattr(self, name, float(value))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", f"ignore_eos={self.ignore_eos!r} must be True or False")
        if not all(is_whole_number(t) for t in self.stop_token_ids or []):
            raise SamplingError("stop_token_ids", f"stop_token_ids={self.stop_token_ids!r} must be token ids "
                                                  "(integers)")
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if not (self.temperature >= 0):
            raise SamplingError("temperature", f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not (0 < self.top_p <= 1):
            raise SamplingError("top_p", f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", f"min_p={self.min_p} must be in [0, 1] (0 is off)")
        if self.top_k is None:
            self.top_k = 0
        if not is_whole_number(self.top_k) or self.top_k < -1:
            raise SamplingError("top_k", f"top_k={self.top_k} must be an integer >= 1 (0 or -1 disables it)")
        self.top_k = int(self.top_k)  # 3.0 -> 3: torch.topk takes only an int
        if self.max_tokens is not None and (not is_integer(self.max_tokens) or self.max_tokens < 1):
            raise SamplingError("max_tokens", f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not is_integer(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise SamplingError("min_tokens", f"min_tokens={self.min_tokens!r} must be an integer in "
                                              f"[0, max_tokens={self.max_tokens}]")
        # torch.Generator takes seeds in [-2**63, 2**64): checked here, because a bad seed found while
        # sampling would fail the whole step, and with it every other request in the batch.
        if self.seed is not None and (not is_integer(self.seed) or not -(1 << 63) <= self.seed < (1 << 64)):
            raise SamplingError("seed", f"seed={self.seed!r} must be an integer in [-2**63, 2**64)")
        if self.logprobs is not None and (not is_integer(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise SamplingError("logprobs", f"logprobs={self.logprobs!r} must be an integer between 0 and 20")
        if self.prompt_logprobs is not None and (not is_integer(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise SamplingError("prompt_logprobs",
                                f"prompt_logprobs={self.prompt_logprobs!r} must be an integer between 0 and 20")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingError(name, f"{name}={getattr(self, name)} must be in [-2, 2] (0 is off)")
        if not self.repetition_penalty > 0:
            raise SamplingError("repetition_penalty",
                                f"repetition_penalty={self.repetition_penalty} must be > 0 (1 is off)")
        bias = self.logit_bias or {}
        if not isinstance(bias, dict) or not all(is_whole_number(t) and t >= 0 and is_finite_real(b)
                                                  and -100 <= b <= 100 for t, b in bias.items()):
            raise SamplingError("logit_bias", f"logit_bias={bias!r} must map token ids to biases in [-100, 100]")
        self.logit_bias = {int(t): float(b) for t, b in bias.items()} or None
        allowed_ids = self.allowed_token_ids
        if allowed_ids is not None and not (isinstance(allowed_ids, (list, tuple)) and allowed_ids
                                            and all(is_whole_number(t) and t >= 0 for t in allowed_ids)):
            raise SamplingError("allowed_token_ids", f"allowed_token_ids={allowed_ids!r} must be a non-empty list "
                                                     "of token ids")
        self.allowed_token_ids = None if allowed_ids is None else sorted({int(t) for t in allowed_ids})
        if self.structured_outputs is not None:
            from meshlm.infer.structured import StructuredOutputs  # here: it imports this module's SamplingError

            self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
        if self.structured_after is not None and not (isinstance(self.structured_after, str) and self.structured_after
                                                      and self.structured_outputs is not None):
            raise SamplingError("structured_after", f"structured_after={self.structured_after!r} must be a non-empty "
                                                    "text, given with structured_outputs")
        if any(not s for s in self.stop):
            raise SamplingError("stop", "stop strings must be non-empty")
        k = self.num_speculative_tokens
        if k is not None and (not is_integer(k) or k < 1):
            raise SamplingError("num_speculative_tokens",
                                f"num_speculative_tokens={k!r} must be an integer >= 1 (or None: the engine's number)")
        for name in ("max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs", "num_speculative_tokens"):
            if getattr(self, name) is not None:  # numpy's integers as Python's (torch.Generator, JSON)
                setattr(self, name, int(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Greedy on the model's own logits: no bias, penalty or grammar changes them."""
        return self.greedy and not self.penalized and self.structured_outputs is None

    @property
    def penalized(self) -> bool:
        """The logits are changed before sampling (allowed tokens, a bias, a penalty, or min_tokens' mask of the
        stop tokens)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1 or self.min_tokens > 0 or self.allowed_token_ids is not None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, where it stands, and which KV blocks hold its cache.

    Invariant while not finished: `num_computed_tokens < num_tokens` -- there is always at least one
    token whose keys/values are still to be computed (the last one, whose logits give the next token).
    """

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    # params.prompt_logprobs: position p's entry (p >= 1) is prompt token p's log-probability given tokens [0, p);
    # None until computed (position 0 has none)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at (last) admission
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (this sequence failed alone)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Tokens proposed to follow this sequence (speculative decoding), set before each step and verified by it
    spec_token_ids: list[int] = field(default_factory=list)
    # params.structured_outputs: its grammar's state (an llguidance matcher, infer/structured.py), which the
    # sampler advances with each token it picks; a matcher that has stopped finishes the sequence
    matcher: object = field(default=None, repr=False)
    # the matcher while the generated text has not yet reached params.structured_after (no grammar until then)
    waiting_matcher: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if not self.request_id:
            self.request_id = str(self.seq_id)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (what a recompute after preemption prefills)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """The token at position `index`; past the sequence's tokens, its proposals (`spec_token_ids`)."""
        n = len(self.prompt_token_ids)
        if index < n:
            return self.prompt_token_ids[index]
        m = len(self.output_token_ids)
        return self.output_token_ids[index - n] if index < n + m else self.spec_token_ids[index - n - m]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold (prompt + max_tokens, capped by the context)."""
        total = self.num_prompt_tokens + self.params.max_tokens
        return total if self.max_model_len is None else min(total, self.max_model_len)

    def append_token(self, token: int, logprobs: dict | None = None) -> None:
        self.output_token_ids.append(int(token))
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop_by_tokens(self) -> str | None:
        """The finish reason implied by the last generated token and the length limits, if any."""
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if last in self.params.stop_token_ids:
            return "stop"
        if self.matcher is not None and self.matcher.is_stopped():  # the grammar is complete
            return "stop"
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if len(self.output_token_ids) >= self.params.max_tokens:
            return "length"
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return "length"
        return None
