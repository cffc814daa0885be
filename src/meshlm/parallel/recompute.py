"""Activation recomputation (checkpointing): trade backward compute for the memory of saved activations.

Responsible for: `apply_recompute(model, mode)`, an in-place transform of the reference Transformer,
and `saved_activation_bytes` / `SavedTensorMeter`, which measure what autograd keeps for backward.

  none       nothing changes.
  full       every transformer block (`model.layers`) keeps only its inputs and runs its forward
             again in backward (`torch.utils.checkpoint`, non-reentrant).
  selective  Korthikanti et al. 2022: the matmul outputs are kept; the attention core
             (`Attention.core`: GQA expansion, the block-causal mask of `documents` when given, scores,
             softmax, attention x V) and the SwiGLU activation
             (`MLP.act`, `Experts.act`: silu(gate) * up) are recomputed in backward. Neither has
             parameters or collectives, so recomputing them costs no communication. Their outputs
             stay (wo and w_down keep them for their weight gradients); what goes is what is inside:
             the GQA-expanded k and v, the softmax statistics (the s x s scores, were the attention
             not fused) and silu(gate).

How it composes with the other transforms (parallelize.py applies it after TP/SP, EP and CP, before
ZeRO and DP): the checkpoint wraps the block's *inner* forward -- `block.forward` is replaced by a
function that checkpoints the original bound forward -- so hooks on the Block itself (ZeRO-3 gathers a
block's parameters in a forward pre-hook and re-gathers them in backward from a hook on its output)
fire once around the checkpointed call and not again while it is recomputed. Hooks on modules inside
the block (tensor parallelism's on `attn` and `mlp`) do run again during recomputation, collectives
included: every rank recomputes the same blocks in the same order, so they still match up. The
checkpoint stops recomputing as soon as the last tensor backward needs is back (torch's early stop),
which is w_down's input: a block's last collective (mlp's reduce-scatter, or all-reduce without
sequence parallelism) is not repeated, the ones before it are (SP: attn's all-gather and
reduce-scatter and mlp's all-gather; no SP: attn's all-reduce).

Recomputation is skipped, and the original forward runs, when gradients are off (evaluation,
generation) or a KV cache is passed (a recomputed cache update would write the cache twice).
Not responsible for: offloading activations to the host, choosing a policy per layer, or the
planner's memory and FLOP model of recomputation (`meshlm.planner`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshlm.models.moe import Experts
from meshlm.models.transformer import MLP, Attention
from meshlm.rules import RECOMPUTE_MODES

MODES = RECOMPUTE_MODES  # parallel.recompute (`meshlm.rules`)
# Set on a model by `apply_recompute`: a second application would checkpoint inside a checkpoint.
_MARK = "_meshlm_recompute"


def _recomputed(fn, *args):
    """`fn(*args)` with its activations recomputed in backward (the plain call when grad is off)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def _recomputed_block(forward, x, cos, sin, cache=None, documents=None):
    """A block's forward under full recomputation; with a KV cache it runs plainly (a recomputed
    cache update would write the cache again, at the wrong position). `documents`: the block-causal
    mask's document ids (`Block.forward`), kept as an input like cos and sin."""
    if cache is not None:
        return forward(x, cos, sin, cache)
    if documents is not None:
        return _recomputed(forward, x, cos, sin, None, documents)
    return _recomputed(forward, x, cos, sin)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make `model` recompute activations in backward (`mode`: none, selective or full); in place.

    Loss and gradients are bit-identical to mode none (the same ops run again on the same inputs).
    Raises ValueError for an unknown mode, a model without `layers`, or a model transformed already.
    """
    if mode not in MODES:
        raise ValueError(f"parallel.recompute={mode!r} is unknown; choose one of {', '.join(MODES)}")
    if getattr(model, _MARK, None) is not None:
        raise ValueError(f"activation recomputation ({getattr(model, _MARK)}) was applied to this model already; "
                         "build a fresh model to change it (a second pass would checkpoint inside a checkpoint)")
    if mode == "none":
        return model
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"apply_recompute expects the reference Transformer (blocks in `model.layers`), "
                         f"got {type(model).__name__}; pass a model built by meshlm.models.build_model")
    setattr(model, _MARK, mode)
    if mode == "full":
        for block in layers.values():
            # An instance attribute shadows Block.forward: nn.Module.__call__ (and so the hooks on
            # the block) runs once around it, the checkpoint only around the original forward.
            block.forward = functools.partial(_recomputed_block, block.forward)
        return model
    for module in layers.modules():
        if isinstance(module, Attention):
            module.core = functools.partial(_recomputed, module.core)
        elif isinstance(module, (MLP, Experts)):
            module.act = functools.partial(_recomputed, module.act)
    return model


# --------------------------------------------------------------------------------------------
# Measuring what backward keeps
# --------------------------------------------------------------------------------------------


class SavedTensorMeter:
    """Context manager: the bytes of the distinct storages autograd saves for backward inside it.

    Parameters (and views of them, such as the transposed weight a linear layer saves) are not
    counted: they exist anyway. Everything else is -- activations, the int64 token ids the
    embedding keeps, and under autocast the low-precision copies of the weights that backward
    uses. Inputs a checkpoint keeps count (it saves them as saved tensors); the tensors it will
    recompute do not (they are not kept). A storage is counted once, whole, however many views of
    it are saved. Only the forward inside the `with` is seen, so enter it around the forward and
    the loss, not the backward (recomputation saves tensors again, briefly).
    """

    def __init__(self, model: nn.Module):
        self._params = list(model.parameters())
        self._storages: dict[int, int] = {}  # data_ptr -> nbytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        # Recomputed per call, not cached: ZeRO-3 re-allocates a block's parameters at every gather.
        if ptr not in self._storages and not isinstance(t, nn.Parameter) and storage.nbytes() > 0 \
                and all(p.untyped_storage().data_ptr() != ptr for p in self._params):
            self._storages[ptr] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_activation_bytes(model: nn.Module, tokens: torch.Tensor, loss_fn) -> int:
    """Bytes autograd keeps for backward after `loss_fn(model(tokens))` (see `SavedTensorMeter`).

    Runs the backward too (so the graph is released and recomputation is exercised); the gradients
    it leaves in `.grad` are the caller's to clear.
    """
    with SavedTensorMeter(model) as meter:
        loss = loss_fn(model(tokens))
    loss.backward()
    return meter.bytes
