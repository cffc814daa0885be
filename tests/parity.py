"""How the parity tests compare a distributed run with the single-process one.

Exactness is proven in float64: there two layouts agree to ~1e-12 on any CPU, so `FP64_TOL` sits
far above the rounding and far below any real bug. fp32 weights after AdamW differ by amounts that
depend on the machine (AdamW divides by sqrt(v), which magnifies summation-order rounding where
gradients are tiny), so fp32 runs compare only losses and gradient norms, relatively (`FP32_REL`);
the norms are what catch a gradient off by a constant factor, which AdamW all but hides.
Every failure says how far off, and where.
"""

import math

import torch

FP64_TOL = 1e-9  # absolute on weights and gradients, relative on losses and norms (float64)
FP32_REL = 1e-5  # relative on losses and gradient norms (float32)


def assert_close_seq(got, want, *, rtol: float, what: str) -> float:
    """Per-step scalars (losses, grad norms): |got - want| <= rtol * |want| at every step, NaN fails.
    Returns the largest relative difference."""
    got, want = [float(x) for x in got], [float(x) for x in want]
    assert len(got) == len(want), f"{what}: {len(got)} steps, want {len(want)}"
    rel = [abs(g - w) / abs(w) if w else abs(g) for g, w in zip(got, want)]
    rel = [r if not math.isnan(r) else math.inf for r in rel]
    bad = [f"step {i}: got {g!r}, want {w!r}, rel diff {r:.2e}"
           for i, (g, w, r) in enumerate(zip(got, want, rel)) if not r <= rtol]
    assert not bad, f"{what}: {len(bad)} of {len(got)} steps off by more than rtol {rtol:.0e}:\n  " + "\n  ".join(bad)
    return max(rel, default=0.0)


def assert_state_close(got: dict, want: dict, *, atol: float, what: str) -> float:
    """Name -> tensor dicts (weights, gradients): same names, shapes and dtypes, and every element
    within `atol`; NaN fails. Returns the largest |difference|."""
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())}"
    worst, where, bad = 0.0, "", []
    for name, w in want.items():
        g = got[name]
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{what}: {name} is {g.dtype}{list(g.shape)}, " \
                                                         f"want {w.dtype}{list(w.shape)}"
        if g.numel() == 0:
            continue
        diff = (g.detach() - w.detach()).abs().nan_to_num(nan=math.inf)
        i = int(diff.argmax())
        d = float(diff.flatten()[i])
        if not d <= atol:
            bad.append(name)
        if d > worst or not where:
            index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), g.shape))
            worst, where = d, f"{name}{list(index)} (got {float(g.flatten()[i])!r}, want {float(w.flatten()[i])!r})"
    assert not bad, f"{what}: max |difference| {worst:.2e} at {where}; {len(bad)} of {len(want)} tensors " \
                    f"exceed atol {atol:.0e}: {bad[:5]}{' ...' if len(bad) > 5 else ''}"
    return worst
