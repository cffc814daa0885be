"""Single-process text generation with the reference model: prefill, then decode token by token.

Responsible for: running a prompt (or a batch of equal-length prompts) through `Transformer` with its
contiguous `KVCache`, picking each next token greedily or by temperature / top-k / top-p / min-p sampling
(reproducible with `seed`), and stopping at `max_new_tokens` or a stop token; `sample`, the one draw
of a next token, and `sampling_probs`, the distribution it draws from, which the serving engine's sampler
uses too.
Not responsible for: tokenisation, paged KV caches, continuous batching or serving (`meshlm.infer`).
"""

from __future__ import annotations

import math

import torch

from meshlm.models.transformer import KVCache, Transformer

# Below this temperature the distribution is argmax up to float32 rounding: dividing by it would
# overflow (or, as a float32 scalar, divide by zero) and give nan, so it is sampled greedily.
MIN_TEMPERATURE = 1e-5


def sample(logits_bv: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row: argmax when temperature is (nearly) 0, else a draw from the filtered distribution.

    The one implementation of temperature / top-k / top-p / min-p, shared by the engine's `Sampler` and the
    single-process `generate` below. Numerically safe for every temperature >= 0 and top_p
    in (0, 1]: the most likely token always stays a candidate, so no row is ever all -inf.
    """
    if temperature < MIN_TEMPERATURE:
        return logits_bv.argmax(dim=-1)
    probs_bv = sampling_probs(logits_bv, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return torch.multinomial(probs_bv, 1, generator=generator)[:, 0]


def sampling_probs(logits_bv: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> torch.Tensor:
    """The distribution `sample` draws from (temperature >= MIN_TEMPERATURE): float32 [rows, vocab], each row
    summing to 1; speculative decoding's verification accepts and resamples against it. `min_p` drops the tokens
    less likely than min_p x the most likely one's probability (after temperature, before top-k and top-p, as
    vLLM orders them)."""
    logits_bv = raw_bv = logits_bv.float()
    # Shifted so each row's largest logit is 0, then scaled by 1/temperature clamped to float32's range:
    # -inf logits stay -inf, finite ones stay finite (a huge temperature is a uniform draw, not inf/inf).
    logits_bv = logits_bv - logits_bv.amax(dim=-1, keepdim=True)
    logits_bv = logits_bv * min(1.0 / temperature, 1.0 / MIN_TEMPERATURE)
    if min_p > 0:  # p / p_max = exp(logit - max logit), and the max is 0 here
        logits_bv = logits_bv.masked_fill(logits_bv < math.log(min_p), float("-inf"))
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
    return probs_bv


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int] | list[list[int]] | torch.Tensor, *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
             seed: int | None = None, stop_token_ids: tuple[int, ...] | list[int] = ()) -> list[int] | list[list[int]]:
    """The new tokens after `prompt_ids` (the prompt itself is not repeated).

    `prompt_ids` is one prompt (a list of ints or a 1-D tensor), giving `list[int]`, or a batch of
    prompts of equal length (a list of lists or a 2-D tensor), giving `list[list[int]]`. Greedy when
    `temperature == 0`. A stop token ends its row and is included as the row's last token, like
    Hugging Face `generate`; the other rows go on until they stop too or reach `max_new_tokens`.
    """
    tokens_bs, batched = _as_batch(prompt_ids)
    _check_args(model, tokens_bs, max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, top_k=top_k, min_p=min_p)
    batch, prompt_len = tokens_bs.shape
    if max_new_tokens == 0:
        return [[] for _ in range(batch)] if batched else []
    device = model.embed.weight.device
    dtype = model.embed.weight.dtype
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    cache = KVCache(model.config, batch, prompt_len + max_new_tokens, device=device, dtype=dtype)

    was_training = model.training
    model.eval()
    try:
        logits_bv = model(tokens_bs.to(device), cache=cache)[:, -1]
        out: list[list[int]] = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            next_b = sample(logits_bv.float(), temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            generator=generator)
            for row in range(batch):
                if not done[row]:
                    out[row].append(int(next_b[row]))
            done |= torch.isin(next_b, stop)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            # Finished rows keep decoding (their outputs are discarded) so the batch stays rectangular.
            logits_bv = model(next_b[:, None], cache=cache)[:, -1]
    finally:
        model.train(was_training)
    return out if batched else out[0]


def _as_batch(prompt_ids) -> tuple[torch.Tensor, bool]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() not in (1, 2):
            raise ValueError(f"prompt_ids has shape {tuple(prompt_ids.shape)}; pass [seq] or [batch, seq]")
        tokens = prompt_ids.long()
        return (tokens[None], False) if tokens.dim() == 1 else (tokens, True)
    prompt_ids = list(prompt_ids)
    if prompt_ids and all(isinstance(p, (list, tuple)) for p in prompt_ids):
        lengths = sorted({len(p) for p in prompt_ids})
        if len(lengths) != 1:
            raise ValueError(f"batched prompts have lengths {lengths}; generate() needs equal lengths "
                             "(pad them yourself, or call it once per prompt)")
        return torch.tensor(prompt_ids, dtype=torch.long), True
    return torch.tensor(prompt_ids, dtype=torch.long)[None], False


def _check_args(model: Transformer, tokens_bs: torch.Tensor, *, max_new_tokens: int, temperature: float,
                top_p: float, top_k: int, min_p: float) -> None:
    config = model.config
    if tokens_bs.shape[-1] == 0:
        raise ValueError("prompt_ids is empty; generation needs at least one prompt token")
    if tokens_bs.numel() and (int(tokens_bs.min()) < 0 or int(tokens_bs.max()) >= config.vocab_size):
        raise ValueError(f"prompt_ids holds ids outside 0..{config.vocab_size - 1} (the model's vocab_size)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    total = tokens_bs.shape[-1] + max_new_tokens
    if total > config.max_seq_len:
        raise ValueError(f"prompt ({tokens_bs.shape[-1]} tokens) + max_new_tokens={max_new_tokens} = {total} "
                         f"exceeds the model's max_seq_len={config.max_seq_len}; ask for fewer tokens")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 = off)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = off)")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p={min_p} must be in [0, 1] (0 = off)")
