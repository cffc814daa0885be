"""The end-of-training sample: what the trained model generates, on every rank, from a whole model.

Responsible for: the prompt's token ids and the room the model's length leaves after them, and the model
generation runs on -- the plain model when this rank holds all of it, else a full copy gathered from the
pipeline's stages and the tensor-parallel shards (ZeRO-3's shards gathered first): the KV cache and the
one-token decode steps do not fit a model whose heads are split (and whose sequence SP splits).
Not responsible for: generation itself (`meshlm.models.generation`) or serving (`meshlm.infer`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from meshlm.config import Config
from meshlm.mesh import Mesh
from meshlm.models import build_model
from meshlm.parallel.parallelize import ParallelModel
from meshlm.parallel.pipeline import full_state_dict as pipeline_full_state_dict
from meshlm.parallel.tensor import full_state_dict
from meshlm.tokenizer import Tokenizer


def prompt_ids(tokenizer: Tokenizer, prompt: str, *, max_seq_len: int, chat: bool = False) -> tuple[list[int], int]:
    """(the prompt's token ids -- a newline's for an empty prompt --, tokens left to generate), or refuse
    a prompt that fills model.max_seq_len. `chat`: the prompt is a chat template's text (`Tokenizer.encode_prompt`)."""
    ids = (tokenizer.encode_prompt(prompt) if chat else tokenizer.encode(prompt)) or tokenizer.encode("\n")
    room = max_seq_len - len(ids)
    if room <= 0:
        raise ValueError(f"prompt of {len(ids)} tokens leaves no room in model.max_seq_len={max_seq_len}")
    return ids, room


def whole_model(cfg: Config, model: nn.Module, parallel: ParallelModel, mesh: Mesh, *,
                device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`model` itself when this rank holds all of it; else a full copy every rank gathers (collective)."""
    if parallel.pipeline is None and not parallel.tensor_parallel:
        return model
    full = build_model(cfg.model, seed=cfg.train.seed, device=device, dtype=dtype)
    zero = parallel.zero
    with zero.full_params() if zero is not None else contextlib.nullcontext():  # ZeRO-3: gathered
        if parallel.pipeline is not None:  # every rank gathers the stages
            mine = full_state_dict(model, mesh) if parallel.tensor_parallel else None
            full.load_state_dict(pipeline_full_state_dict(parallel.pipeline, full, mesh, mine=mine))
        else:
            full.load_state_dict(full_state_dict(model, mesh))
    return full
