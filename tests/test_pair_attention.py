"""One (query chunk, key chunk) pair of context-parallel attention (`parallel/pair_attention.py`): the fused
kernel (where PyTorch has one) and the explicit computation agree, forward (output and log-sum-exp) and
backward (given the whole attention's output and log-sum-exp), for a chunk against itself, an earlier chunk,
and a document mask that leaves some query rows no key of the pair; bf16 inputs stay bf16 through the kernel."""

import pytest
import torch

from meshlm.parallel import pair_attention as pa


def _inputs(dtype, b=2, h=4, c=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, c, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(4)]


def _explicit(monkeypatch):
    monkeypatch.setattr(pa, "_kernel", lambda q, allowed: None)


@pytest.mark.parametrize("case", ["causal", "full", "documents"])
def test_the_cpu_kernel_matches_the_explicit_pair_in_fp64(monkeypatch, case):
    q, k, v, dout = _inputs(torch.float64)
    allowed = None
    if case == "documents":  # some rows see none of these keys: their lse is the dtype's lowest, finite
        allowed = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.5
        allowed[0, 3] = False
    kw = dict(causal=case == "causal", scale=0.25, allowed=allowed)
    assert pa._kernel(q, allowed) == "cpu"
    out, lse, _ = pa.pair_forward(q, k, v, **kw)
    # the backward takes the whole attention's out / lse: stand them in by a second key block merged in
    whole_lse = torch.logaddexp(lse, torch.zeros_like(lse))
    whole_out = out * torch.exp(lse - whole_lse)[..., None]
    grads = pa.pair_backward(dout, q, k, v, whole_out, whole_lse, **kw)
    with monkeypatch.context() as m:
        _explicit(m)
        ref_out, ref_lse, _ = pa.pair_forward(q, k, v, **kw)
        ref_grads = pa.pair_backward(dout, q, k, v, whole_out, whole_lse, **kw)
    seen = torch.ones_like(lse, dtype=torch.bool) if allowed is None else allowed.any(-1)[:, None].expand_as(lse)
    torch.testing.assert_close(out[seen], ref_out[seen], rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=0, atol=1e-12)
    # a row that sees no key of the pair: finite, and its lse the dtype's lowest (give or take log(keys)), so
    # that its weight in any merge with a pair it does see is exactly 0 -- whatever its output holds
    assert out[~seen].isfinite().all() and (lse[~seen] < -1e300).all() and (ref_lse[~seen] < -1e300).all()
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bf16_inputs_stay_bf16_with_a_full_precision_log_sum_exp(monkeypatch):
    q, k, v, _ = _inputs(torch.bfloat16)
    out, lse, _ = pa.pair_forward(q, k, v, causal=True, scale=0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    with monkeypatch.context() as m:
        _explicit(m)
        ref, ref_lse, _ = pa.pair_forward(q, k, v, causal=True, scale=0.25)
    assert ref.dtype == torch.float32  # the fallback computes in fp32
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-2)
