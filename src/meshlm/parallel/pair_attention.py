"""One (query chunk, key chunk) pair of attention and its log-sum-exp, forward and backward: the unit that
ring and all-gather context parallelism (`parallel/context.py`) merge across key blocks.

Responsible for: computing a pair in the inputs' own dtype with a fused kernel that also returns the
log-sum-exp, where PyTorch has one for the device and the case (on CPU its flash-attention kernel, every
float dtype, with a document mask as an additive bias; on CUDA its flash-attention kernel, fp16/bf16, no
mask, head_dim a multiple of 8 up to 256), and otherwise explicitly: scores, softmax and products in the
promoted dtype (fp32 under bf16/fp16) with autocast off. Either way the log-sum-exp is in the promoted dtype,
so merges across pairs and the backward's probabilities keep full precision; only the matrix products run in
bf16 when the inputs are bf16, as in any fused attention.
Not responsible for: which pairs exist (the causal split by chunk index and documents, `context._pairs`),
merging partial results (`context.merge_partials`), or GQA (the caller expands K/V to the query heads).

The backward is FlashAttention's: given the whole attention's output and log-sum-exp for these queries (not
the pair's own), P = exp(S - lse) is the pair's share of the true probabilities, so the pair's dQ, dK, dV are
its exact share of the whole gradients; delta = rowsum(dO * O) is the whole output's.
"""

from __future__ import annotations

import contextlib

import torch

_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of log-sum-exps, merges and gradient sums: fp32 for bf16/fp16 inputs, else their own."""
    return torch.promote_types(dtype, torch.float32)


def _kernel(q: torch.Tensor, allowed: torch.Tensor | None) -> str | None:
    if q.device.type == "cpu" and q.dtype in (torch.float64, torch.float32, *_HALF):
        return "cpu"
    if q.device.type == "cuda" and q.dtype in _HALF and allowed is None and q.shape[-1] % 8 == 0 \
            and q.shape[-1] <= 256:
        return "cuda"
    return None


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, queries, keys] bool -> an additive [b, 1, queries, keys] bias: 0 where allowed, the dtype's lowest
    finite value elsewhere (finite, so a row that sees no key of the pair stays finite; `context` explains)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]


def _scores(q, k, *, causal: bool, scale: float, allowed: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is not None:  # documents: [b, queries, keys], the causal part included
        return s.masked_fill(~allowed[:, None], torch.finfo(s.dtype).min)
    if causal:  # a chunk against itself: query i sees keys 0..i
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _no_autocast(device_type: str):
    if device_type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


class CudaAux:
    """What CUDA's flash kernel returns beside its output, which its backward takes back. For dense (not
    variable-length) inputs of one shape it is the same for every pair, so one forward's serves them all."""

    def __init__(self, cum_q, cum_k, max_q, max_k, rng_state, unused):
        self.args = (cum_q, cum_k, max_q, max_k)
        self.rng = (rng_state, unused)


def pair_forward(q, k, v, *, causal: bool, scale: float, allowed: torch.Tensor | None = None):
    """q [b, h, c, d], k/v [b, h, c', d] -> (out [b, h, c, d], lse [b, h, c] in `compute_dtype`, aux): the
    pair's attention. `causal`: a chunk against itself; `allowed` [b, c, c']: the document mask (causal part
    included), or None. `aux`: what `pair_backward` needs from a CUDA kernel (None elsewhere)."""
    kernel, cdt = _kernel(q, allowed), compute_dtype(q.dtype)
    with _no_autocast(q.device.type):
        if kernel == "cpu":
            bias = None if allowed is None else _bias(allowed, q.dtype)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal and allowed is None, attn_mask=bias, scale=scale)
            return out, lse.to(cdt), None
        if kernel == "cuda":
            out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                                  scale=scale)
            return out, lse.to(cdt), CudaAux(*rest[:6])
        s = _scores(q.to(cdt), k.to(cdt), causal=causal, scale=scale, allowed=allowed)
        lse = torch.logsumexp(s, dim=-1)
        return torch.matmul(torch.exp(s - lse[..., None]), v.to(cdt)), lse, None


def pair_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, allowed: torch.Tensor | None = None,
                  aux: CudaAux | None = None):
    """The pair's (dq, dk, dv) given the whole attention's `out` (q's dtype) and `lse` for these queries, and
    dout = dL/d(out). On CUDA `aux` is any `pair_forward` result's aux of the same shapes."""
    kernel, cdt = _kernel(q, allowed), compute_dtype(q.dtype)
    with _no_autocast(q.device.type):
        if kernel == "cpu":
            bias = None if allowed is None else _bias(allowed, q.dtype)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.to(torch.float32 if q.dtype in _HALF else q.dtype), 0.0,
                causal and allowed is None, attn_mask=bias, scale=scale)
        if kernel == "cuda":
            if aux is None:
                raise ValueError("pair_backward on CUDA needs the aux of a pair_forward of the same shapes")
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse.float(), *aux.args, 0.0, causal, *aux.rng, scale=scale)
        qc, kc, vc, doc = q.to(cdt), k.to(cdt), v.to(cdt), dout.to(cdt)
        p = torch.exp(_scores(qc, kc, causal=causal, scale=scale, allowed=allowed) - lse[..., None])
        delta = (doc * out.to(cdt)).sum(-1)
        dv = torch.matmul(p.transpose(-1, -2), doc)
        ds = p * (torch.matmul(doc, vc.transpose(-1, -2)) - delta[..., None])
        return torch.matmul(ds, kc) * scale, torch.matmul(ds.transpose(-1, -2), qc) * scale, dv
