"""What a serving deployment is asked to do: `Workload` -- prompt and output lengths, one batching mode (a static
batch, clients in flight, the offline optimum, Poisson arrivals or the highest rate meeting latency targets), the
engine's limits (its token budget per iteration, its cap on running requests), latency targets, disaggregation, and
the share of each prompt the prefix cache holds.

Responsible for: checking those inputs (a message naming the flag and the fix), and what follows from them alone:
the prompt tokens a request prefills, the context they attend over, the prefix every running request shares, and
the decodes of an iteration as `serving.iteration_time` takes them.
Not responsible for: what any of it costs on a deployment (`serving_modes.py`, whose module docstring says how each
mode is priced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


# Prompt tokens per iteration when chunking: TensorRT-LLM's default max_num_tokens (8192).
DEFAULT_PREFILL_CHUNK = 8192
# The tail of Poisson arrivals' latencies reported (and that `--request-rate max` holds to the targets): p99.
DEFAULT_PERCENTILE = 99.0


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    batch: int | None = None  # static batch
    concurrency: int | None = None  # continuous batching
    offline: bool = False
    request_rate: float | None = None  # Poisson, requests/s
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_batch: int | None = None  # the engine's cap on running sequences per dp rank (e.g. vLLM's max_num_seqs)
    disaggregate: tuple[int, int] | None = None  # (prefill GPUs, decode GPUs)
    max_ttft_s: float | None = None  # latency targets of the offline optimum or of max_rate (a serving SLO)
    max_tpot_s: float | None = None
    max_rate: bool = False  # the highest Poisson rate whose tails meet the targets (`--request-rate max`)
    percentile: float | None = DEFAULT_PERCENTILE  # the tail of Poisson arrivals' latencies (None: their means)
    # a disaggregated deployment's decode pool (`serving_modes.disaggregated`): its prompts were prefilled, and their
    # first tokens made, on the prefill pool -- its iterations carry decodes only and add nothing to the TTFT
    prefilled_elsewhere: bool = False
    # the share of each prompt's tokens the engine finds in its prefix cache (`--prefix-hit`; serving_modes' module
    # docstring), and whether that prefix is one that every request shares, its KV held once (`--prefix-shared`)
    prefix_hit: float = 0.0
    prefix_shared: bool = False

    def __post_init__(self):
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"--input-len {self.input_len} and --output-len {self.output_len} must be >= 1")
        modes = [self.batch is not None, self.concurrency is not None, self.offline, self.request_rate is not None,
                 self.max_rate]
        if sum(modes) > 1:
            raise ValueError("give one of --batch, --concurrency, --offline, --request-rate")
        if not 0 <= self.prefix_hit < 1:
            raise ValueError(f"--prefix-hit {self.prefix_hit:g} must be at least 0 and below 1: the share of each "
                             f"prompt's tokens found in the prefix cache (e.g. 0.5)")
        if self.prefix_shared and not self.prefix_hit:
            raise ValueError("--prefix-shared says the cached prefix is one every request shares: give its share of "
                             "the prompt with --prefix-hit (e.g. --prefix-hit 0.75)")
        if self.percentile is not None and not 0 < self.percentile < 100:
            raise ValueError(f"--percentile {self.percentile:g} must be between 0 and 100, e.g. 99")
        for name in ("batch", "concurrency", "request_rate", "prefill_chunk", "max_batch"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be > 0")
        for name, value in (("--max-ttft-ms", self.max_ttft_s), ("--max-tpot-ms", self.max_tpot_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value * 1e3:g} must be > 0")
        if (self.max_ttft_s or self.max_tpot_s) and self.mode not in ("offline", "max-rate"):
            raise ValueError("--max-ttft-ms / --max-tpot-ms choose the offline concurrency or the highest rate "
                             "(--request-rate max); with --batch, --concurrency or --request-rate R the TTFT and "
                             "TPOT are the answer, not a target")
        if self.disaggregate and self.mode in ("request-rate", "max-rate", "static"):
            raise ValueError("--disaggregate prices the pools at --offline or --concurrency; Poisson arrivals "
                             "(--request-rate) and a static batch (--batch) are modelled on one pool only")
        if self.max_rate and not (self.max_ttft_s or self.max_tpot_s):
            raise ValueError("--request-rate max needs a target: --max-ttft-ms and/or --max-tpot-ms (without one "
                             "the highest rate is the offline throughput, --offline)")

    @property
    def prefill_len(self) -> int:
        """Prompt tokens a request prefills: those past its cached prefix (`prefix_hit`), at least the last one,
        whose logits make the first token."""
        return max(1, self.input_len - math.floor(self.prefix_hit * self.input_len))

    @property
    def prefill_ctx(self) -> float:
        """The mean context a prefilled prompt token attends over: the cached prefix, then half the rest."""
        return self.input_len - self.prefill_len / 2

    @property
    def shared_prefix_len(self) -> int:
        """Prompt tokens every running request shares, their KV held once: the cached prefix where it is one
        (`prefix_shared`), else none."""
        return self.input_len - self.prefill_len if self.prefix_shared else 0

    def decoding(self, requests: float) -> dict:
        """An iteration's decodes as `serving.iteration_time` takes them: `requests` sequences over I + O / 2 cached
        tokens each (the mean over a request's life), the first `shared_prefix_len` of them a prefix all share."""
        return dict(decodes=requests, kv_len=self.input_len + self.output_len / 2, shared_prefix=self.shared_prefix_len)

    @property
    def mode(self) -> str:
        if self.batch is not None:
            return "static"
        if self.concurrency is not None:
            return "concurrency"
        if self.max_rate:
            return "max-rate"
        return "request-rate" if self.request_rate is not None else "offline"
