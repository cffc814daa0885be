"""Loading a checkpoint: into any layout for resuming, into one process for inference.

Responsible for: restoring RNG states, `load_checkpoint` (DCP reads into each rank's pieces exactly the parts
of the saved pieces they overlap, whatever the two layouts), `load_weights` (the safetensors copy, pieces put
together, every tensor accounted for) and `load_checkpoint_for_inference` (model, config and tokenizer, no
optimizer state and no pickle).
Not responsible for: deciding which rank's extras to take after a change of layout (the trainer).
"""

from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from meshlm.checkpoint.find import (
    META,
    PIECES,
    CheckpointError,
    check_model_config,
    config_from_dict,
    one_line,
    other_checkpoint_hint,
    peer_failed,
    read_meta,
    read_rank_file,
    resolve_checkpoint,
    verify_checkpoint,
)
from meshlm.checkpoint.safe_read import SafePlanner, SafeReader, UnsafeCheckpoint, read_metadata
from meshlm.checkpoint.shards import (
    after_load,
    assemble,
    checkpoint_state,
)
from meshlm.config import Config


def set_rng_state(state: dict) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if isinstance(cuda[0], list):  # written by earlier meshlm: every visible device's state; take ours
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(torch.tensor(cuda, dtype=torch.uint8))


def _dcp_load(state: dict, path: Path, *, listed: set[str]) -> None:
    """DCP reads this rank's pieces; nothing of the checkpoint runs (`safe_read`: its `.metadata` is a pickle)."""
    try:
        metadata = read_metadata(path, listed=listed)
    except UnsafeCheckpoint as e:
        raise CheckpointError(f"{path / '.metadata'} is refused: {e} (a crafted checkpoint? meshlm runs nothing "
                              f"from one); {other_checkpoint_hint(path, resume=True)}") from None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafePlanner())
    # DCP wraps reader failures in CheckpointException, a BaseException subclass, so name it.
    except (Exception, CheckpointException) as e:
        if peer_failed(e):  # the files were verified: another rank stopped (and said why), not this checkpoint
            raise CheckpointError(f"loading checkpoint {str(path)!r} stopped because another rank did (see its "
                                  f"error; {one_line(e, 80)})") from e
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded ({one_line(_cause(e))}); "
                              f"{other_checkpoint_hint(path, resume=True)}") from e


def _cause(e: BaseException) -> BaseException:
    """What failed inside DCP (its CheckpointException wraps each rank's exception with a traceback)."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    for failure in (failures or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    config: Config, rank: int = 0, mesh=None, checksums: bool = True) -> dict:
    """Load model (+ optimizer) state in place; return {"step", "config", "rank_extra"}.

    Each rank reads only the parts of the saved pieces that overlap its own (any layout saved it); a
    sharded model needs `mesh`. `checksums=False`: the caller verified them (`verify_checkpoint`)."""
    path = Path(path)
    listed = set(verify_checkpoint(path, checksums=checksums, resume=True)["files"])  # before any of it is parsed
    meta = read_meta(path, resume=True)
    check_model_config(meta["config"].get("model") or {}, config.model, where=f"{path} ({META})")
    rank_file = path / f"rank_{rank:05d}.json"
    if rank >= int(meta["world_size"]):
        raise CheckpointError(f"checkpoint {str(path)!r} was saved by {meta['world_size']} ranks and has no "
                              f"{rank_file.name} (this rank's RNG and data position are unknown)")
    rank_extra = read_rank_file(rank_file)  # before DCP reads anything
    state = checkpoint_state(model, optimizer, mesh)  # this rank's pieces: DCP reads only what overlaps them
    _dcp_load(state, path, listed=listed)
    after_load(state, model=model, optimizer=optimizer)
    return {"step": int(meta["step"]), "config": meta["config"], "rank_extra": rank_extra}


def load_weights(path: str | Path, model: nn.Module, *, checksums: bool = True) -> None:
    """The weights of checkpoint `path` into `model` (the full, unsharded model), from its safetensors
    files only -- no pickle is read, so a checkpoint from anywhere is safe to generate from. Only the files
    its manifest lists (and verified) are read: a stray file next to them is ignored."""
    path = Path(path)
    listed = verify_checkpoint(path, checksums=checksums)["files"]
    named: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    for f in sorted(path / name for name in listed if re.fullmatch(r"model_rank_\d+\.safetensors", name)):
        try:
            with safe_open(str(f), framework="pt") as st:
                layout.update(json.loads((st.metadata() or {}).get(PIECES, "{}")))
                named.update({name: st.get_tensor(name) for name in st.keys()})
        except Exception as e:  # safetensors' own error type is no ValueError
            raise CheckpointError(f"{f} cannot be read ({one_line(e, 80)}); {other_checkpoint_hint(path)}") from None
    try:
        state = assemble(named, layout)  # a sharded run wrote pieces (each once); put the full tensors together
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {e}; {other_checkpoint_hint(path)}") from None
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no weights for {missing[:3]}"
                              f"{' ...' if len(missing) > 3 else ''}; {other_checkpoint_hint(path)}")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # unexpected names, or shapes its meta.json's model does not have
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model its meta.json describes "
                              f"({one_line(e, 160)}); {other_checkpoint_hint(path)}") from None


def load_checkpoint_for_inference(path: str | Path, *, device: str | torch.device = "cpu",
                                  dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Config, Any]:
    """(model in eval mode, config, tokenizer) from a run directory or a checkpoint; no optimizer state."""
    from meshlm.models import build_model
    from meshlm.tokenizer import load_saved_tokenizer

    ckpt = resolve_checkpoint(path)
    listed = verify_checkpoint(ckpt)["files"]  # before meta.json is parsed
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"])
    model = build_model(cfg.model, seed=cfg.train.seed)
    load_weights(ckpt, model, checksums=False)  # verified just above
    # The copy the run saved (verified), never a stray file; else data.tokenizer, or bytes.
    tokenizer = load_saved_tokenizer(ckpt, listed, cfg.data.tokenizer)
    return model.to(device=device, dtype=dtype).eval(), cfg, tokenizer
