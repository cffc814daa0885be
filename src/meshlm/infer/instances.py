"""The layout of each instance of disaggregated serving (`infer/disaggregated.py`): parsed and checked, torch-free.

Responsible for: "tp=2" or "tp=1,cp=2" per instance -- the keys of the serving planner's `--layout`
(`meshlm plan infer --layout tp=T --disaggregate PREFILL_GPUS:DECODE_GPUS` prices the same split when both
instances share a layout) -- and its refusals against a model's config, each naming the value and the fix, before
any rank starts (`meshlm serve --prefill/--decode` checks in its front process, which imports no torch).
Not responsible for: running the instances (`infer/disaggregated.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.rules import check_tensor_parallel

INSTANCE_KEYS = ("tp", "cp")  # what an instance's layout may say (the planner's --layout adds pp, ep, dp)


@dataclass(frozen=True)
class InstanceLayout:
    """One instance's layout: tp x cp ranks."""

    tp: int = 1
    cp: int = 1

    @property
    def ranks(self) -> int:
        return self.tp * self.cp

    def label(self) -> str:
        return f"tp={self.tp},cp={self.cp}"


def parse_instance(text: str, *, role: str) -> InstanceLayout:
    """`tp=2`, `cp=2` or `tp=1,cp=2` (any order) -> InstanceLayout; ValueError naming the item and the fix.
    `role`: "prefill" or "decode" (the option named in errors)."""
    kw: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in INSTANCE_KEYS:
            also = " (pp, ep and dp are the planner's; the server runs tp and cp)" if key in ("pp", "ep", "dp") else ""
            raise ValueError(f"--{role} {text!r}: unknown key {key!r}{also}; give tp=N and/or cp=M, e.g. --{role} "
                             "tp=1,cp=2")
        if not sep or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--{role} {text!r}: {item!r} needs a whole number >= 1, e.g. {key}=2")
        if key in kw:
            raise ValueError(f"--{role} {text!r}: {key} is given twice; give it once")
        kw[key] = int(value)
    return InstanceLayout(**kw)


def check_instances(model_cfg, prefill: InstanceLayout, decode: InstanceLayout) -> None:
    """ValueError for a layout that cannot serve `model_cfg` (a `config.ModelConfig`): tp must divide the
    heads, kv heads, vocabulary and MLP width (`rules.check_tensor_parallel`) and, for a MoE, the experts."""
    for role, lo in (("prefill", prefill), ("decode", decode)):
        try:
            check_tensor_parallel(model_cfg, lo.tp)
            if model_cfg.is_moe and model_cfg.num_experts % lo.tp:
                raise ValueError(f"model.num_experts={model_cfg.num_experts} is not divisible by tp={lo.tp} "
                                 "(serving splits the experts over the tp ranks)")
        except ValueError as e:
            raise ValueError(f"--{role} {lo.label()}: {e}") from None


def disaggregate_label(prefill: InstanceLayout, decode: InstanceLayout) -> str:
    """The split in the serving planner's words: `--disaggregate P:D` (ranks of each instance)."""
    return f"{prefill.ranks}:{decode.ranks}"
