"""AdamW over a ZeRO flat shard: the optimizer half of ZeRO-1/2/3 (`parallel/zero.py` is the other).

Responsible for: `ZeroAdamW(zero, ...)`, an AdamW whose one parameter is this rank's flat fp32 master
shard (`zero.param_shard`, whose `.grad` is the reduce-scattered gradient shard), applying the same
elementwise arithmetic as `torch.optim.AdamW(foreach=False)` with the per-parameter decay rule
(>= 2-D tensors decayed) applied to the ranges of the shard that hold such tensors; after the step it all-gathers the updated
parameters (stages 1/2; stage 3 gathers each unit when its next forward needs it). Its state is
read and written in the per-parameter layout of the unsharded AdamW, each rank its own pieces of it
(`meshlm.checkpoint.shards`; `checkpoint_param_groups`, `load_sharded_state`), so a checkpoint moves between
zero stages and data-parallel sizes without any rank holding a full tensor.
Not responsible for: the gradient reduction, the shard layout or parameter gathering (`zero.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.parallel.zero import ZeroSharding


_UPDATE_SLICE = 1 << 22  # elements updated at a time (elementwise: the same numbers as all at once)


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW on this rank's flat parameter shard(s); `step()` also all-gathers the updated parameters.

    One param group per ZeRO sharding of the model (one, or a `ZeroGroup`'s parts: expert parallelism
    shards the experts over their own group), each holding its flat fp32 shard (so `set_lr` and the
    trainer's interface work), whose `.grad` is that sharding's gradient shard. The update is the same
    elementwise arithmetic as `torch.optim.AdamW(foreach=False)`, with the decay applied to the decayed
    tensors' ranges.
    """

    def __init__(self, zero: ZeroSharding, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float):
        self.zero = zero
        self.parts = list(zero.parts)
        self._params_by_id = {id(p): p for z in self.parts for b in z.buckets for p in b.params}
        super().__init__([{"params": [z.param_shard]} for z in self.parts],
                         dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # where each shard holds >= 2-D tensors (padding is not decayed; its values stay zero anyway)
        self.decay_ranges = [z.shard_ranges(lambda p: p.dim() >= 2) for z in self.parts]
        for z in self.parts:
            shard = z.param_shard
            self.state[shard] = {"step": torch.zeros((), dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(shard), "exp_avg_sq": torch.zeros_like(shard)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The model's full `.grad` (stage 1, or accumulation) must not carry into the next step; the
        # gradient shard is dropped too (the next step's first reduce-scatter allocates it again).
        for z in self.parts:
            for b in z.buckets:
                for p in b.params:
                    p.grad = None
            z.release_grad_shard()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ZeroAdamW takes no closure"
        for z, group, decay_ranges in zip(self.parts, self.param_groups, self.decay_ranges):
            self._step_part(z, group, decay_ranges)

    def _step_part(self, z: ZeroSharding, group: dict, decay_ranges: list[tuple[int, int]]) -> None:
        lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        param = group["params"][0]
        grad, state = z.grad_shard, self.state[param]
        state["step"] += 1
        if wd != 0:
            for start, end in decay_ranges:  # in place by a Python scalar, as torch's AdamW rounds it
                param[start:end].mul_(1 - lr * wd)
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = float(state["step"])
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        for start in range(0, param.numel(), _UPDATE_SLICE):  # temporaries of a slice, not of the shard
            part = slice(start, start + _UPDATE_SLICE)
            denom = (state["exp_avg_sq"][part].sqrt() / bias_correction2_sqrt).add_(eps)
            param[part].addcdiv_(state["exp_avg"][part], denom, value=-lr / bias_correction1)
        # ZeRO-1/2 keep full parameters on every rank: bring every rank's updated shard back. ZeRO-3
        # gathers each unit from the shard when its next forward needs it.
        if z.stage < 3:
            for pid, full in z.gather_full(param).items():
                self._params_by_id[pid].copy_(full)

    # -- the per-parameter layout of checkpoints ------------------------------------------------

    @staticmethod
    def _named(z: ZeroSharding) -> list[tuple[str, nn.Parameter]]:
        # registration order, as `torch.distributed.checkpoint.state_dict.get_state_dict` names them
        return [(n, p) for b in z.buckets for n, p in zip(b.names, b.params)][::-1]

    def checkpoint_param_groups(self) -> list[dict]:
        """The param groups `get_state_dict(model, torch.optim.AdamW)` writes: decayed and not, by parameter
        name, with every hyperparameter key torch's AdamW has (DCP matches saved keys against them)."""
        names = [(n, p) for z in self.parts for n, p in self._named(z)]
        plain = torch.optim.AdamW([torch.zeros(1)], foreach=False,
                                  **{k: v for k, v in self.param_groups[0].items() if k != "params"})
        group = {k: v for k, v in plain.param_groups[0].items() if k != "params"}
        return [{**group, "weight_decay": group["weight_decay"] if decayed else 0.0,
                 "params": [n for n, p in names if (p.dim() >= 2) == decayed]} for decayed in (True, False)]

    @torch.no_grad()
    def load_sharded_state(self, sd: dict) -> None:
        """After a checkpoint was read into this rank's shards in place (`meshlm.checkpoint.shards`): set the
        step counts from `sd["state"]` (per-parameter, as AdamW stores them) and, under ZeRO-1/2, bring
        the full parameters from the loaded master shards (one all-gather per bucket)."""
        for z in self.parts:
            named = self._named(z)
            missing = [n for n, _ in named if n not in sd["state"]]
            if missing:
                raise ValueError(f"the optimizer state has no entry for {missing[:3]}; it belongs to another model")
            steps = {float(sd["state"][n]["step"]) for n, _ in named}
            assert len(steps) == 1, f"per-parameter AdamW steps differ: {steps}"
            self.state[z.param_shard]["step"].fill_(steps.pop())
            if z.stage < 3:
                for pid, full in z.gather_full(z.param_shard).items():
                    self._params_by_id[pid].copy_(full)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the moments; the fp32 master shards excluded)."""
        return sum(s[k].numel() * s[k].element_size() for z in self.parts for s in [self.state[z.param_shard]]
                   for k in ("exp_avg", "exp_avg_sq"))
