"""The layout of a serving deployment: `ServingLayout` (tp, pp, cp, ep, dp), read from `--layout` text
(`parse_serving_layout`) and checked against the model it serves (`check_serving_layout`).

Responsible for: the degrees and what follows from them alone (GPUs, a stage's GPUs, attention data parallelism).
Not responsible for: where the weights and KV sit under it, or what an iteration costs (`serving.py`, whose module
docstring says how a deployment's GPUs are arranged).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.planner.serving_model import ServedModel


@dataclass(frozen=True)
class ServingLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def stage(self) -> int:
        """GPUs of one pipeline stage (dp x tp x cp)."""
        return self.dp * self.tp * self.cp

    @property
    def attention_dp(self) -> bool:
        """Attention data parallelism: dp ranks that attend apart and meet at every MoE layer's expert ranks."""
        return self.dp > 1 and self.ep > 1

    def label(self) -> str:
        return ",".join(f"{k}={getattr(self, k)}" for k in ("tp", "pp", "cp", "ep", "dp"))


def parse_serving_layout(text: str, *, gpus: int | None = None) -> ServingLayout:
    """`tp=8,pp=1,cp=1,ep=1,dp=1`; dp (when not given) fills --gpus."""
    kw = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key not in ServingLayout.__dataclass_fields__ or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--layout item {item!r}: expected tp|pp|cp|ep|dp=N with N >= 1, e.g. tp=8,dp=2")
        kw[key] = int(value)
    if "dp" not in kw and gpus:
        rest = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
        if gpus % rest:
            raise ValueError(f"--layout {text!r}: tp x pp x cp = {rest} does not divide --gpus {gpus}")
        kw["dp"] = gpus // rest
    lo = ServingLayout(**kw)
    if gpus and lo.world != gpus:
        raise ValueError(f"--layout {text!r} uses {lo.world} GPUs (dp x pp x tp x cp), --gpus is {gpus}")
    return lo


def check_serving_layout(sm: ServedModel, lo: ServingLayout) -> None:
    cfg = sm.cfg
    if cfg.num_heads % lo.tp:
        raise ValueError(f"tp={lo.tp} must divide num_heads={cfg.num_heads}")
    if lo.pp > cfg.num_layers:
        raise ValueError(f"pp={lo.pp} exceeds the model's {cfg.num_layers} layers")
    if lo.ep > 1 and not cfg.is_moe:
        raise ValueError(f"ep={lo.ep} needs a MoE model; {cfg.preset or 'this model'} is dense (use ep=1)")
    # ep need not divide the experts: engines place redundant copies of busy experts (DeepSeek's EPLB: 288
    # physical experts for 256 on EP72/EP144), so a rank holds num_experts / ep of them on average.
    if lo.ep > 1 and lo.stage % lo.ep:
        raise ValueError(f"ep={lo.ep} must divide the stage's dp x tp x cp = {lo.stage} GPUs")
