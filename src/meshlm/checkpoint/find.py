"""Finding a run's checkpoints and trusting them: names, the `latest` pointer, the manifest, meta.json.

Responsible for: where checkpoints live (`checkpoints_root`, `step_N` names), which is the latest complete one
and the fallback when `latest` is damaged (`latest_checkpoint`, `resume_checkpoint`), whether a run directory
may be started or resumed (`check_run_dir`, before any rank starts), verifying a checkpoint's manifest
(sizes and sha256 of every file) before anything in it is parsed, and reading its meta.json (format, step,
layout, config) with a one-line error naming the file and the fix when any of it is wrong.
Not responsible for: writing (`checkpoint/save.py`) or reading tensors (`checkpoint/load.py`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from meshlm.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from meshlm.files import sha256_file
from meshlm.mesh import ParallelDims

FORMAT_VERSION = 3  # 3: every rank writes its own pieces; 2: full tensors (read too); 1: pickled rank files


_READABLE_FORMATS = (2, 3)


META = "meta.json"


MANIFEST = "manifest.json"
PIECES = "meshlm.pieces"  # safetensors metadata: where each piece that is not a whole tensor belongs


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, in one line naming the file and the fix (the CLI prints it, exit 2)."""


def _step_of(path: Path) -> int:
    return int(path.name[len("step_"):])


def _is_complete(path: Path) -> bool:
    """A published checkpoint: a step_N name (never step_N.tmp) holding its manifest, which is written last."""
    return re.fullmatch(r"step_\d+", path.name) is not None and (path / MANIFEST).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Oldest first, by step number (as names, step_1000000 would sort before step_999999)."""
    return sorted((p for p in root.glob("step_*") if _is_complete(p)), key=_step_of)


def _read_pointer(root: Path) -> tuple[Path | None, str | None]:
    """(the checkpoint `latest` names, None) if it is a complete one; else (None, what is wrong with it)."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None, f"{pointer} is missing"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None, f"{pointer} cannot be read"
    if re.fullmatch(r"step_\d+", name) is None:
        return None, f"{pointer} does not name a checkpoint ({name[:40]!r})"
    if not _is_complete(root / name):
        return None, f"{pointer} names {name}, which is not a complete checkpoint"
    return root / name, None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint the `latest` pointer names; None when the run has no checkpoint at all.

    Strict (inference, `meshlm verify`): a damaged pointer next to complete checkpoints raises
    CheckpointError naming it and the newest complete one. A `step_N.tmp/` left by a crash is never
    picked up. `--resume` is lenient instead: `resume_checkpoint`.
    """
    root = checkpoints_root(run_dir)
    complete = complete_checkpoints(root) if root.is_dir() else []
    path, problem = _read_pointer(root)
    if path is not None:
        return path
    if not complete:
        return None
    intact = newest_intact(complete)  # a fix never names a damaged checkpoint
    if intact is None:
        raise CheckpointError(f"{problem}, and no checkpoint in {root} is intact ("
                              f"{', '.join(p.name for p in complete)} do not match their manifests): restore them "
                              "from a copy, or train the run again")
    raise CheckpointError(f"{problem}; the newest intact checkpoint is {intact.name}: pass {intact}, or "
                          f"write {intact.name} into {root / 'latest'}")


def resume_checkpoint(run_dir: str | Path) -> tuple[Path, str | None]:
    """(the checkpoint `--resume` continues from, a note when it is not the one `latest` names).

    `latest`, or when that pointer is damaged the newest complete checkpoint. Raises CheckpointError
    when there is none (`--resume` never starts afresh by itself, and never deletes anything)."""
    root = checkpoints_root(run_dir)
    path, problem = _read_pointer(root)
    if path is not None:
        return path, None
    complete = complete_checkpoints(root) if root.is_dir() else []
    if complete:
        return complete[-1], f"{problem}: resuming from the newest complete checkpoint, {complete[-1].name}"
    found = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
    if found:
        raise CheckpointError(f"--resume: {root} holds no complete checkpoint, only incomplete ones without "
                              f"{MANIFEST} ({', '.join(found[:4])}: a crash during their save?); start afresh "
                              "with --overwrite instead of --resume (this deletes them)")
    raise CheckpointError(f"--resume: {root} holds no checkpoint; run without --resume to start afresh")


def has_complete_checkpoint(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a published checkpoint (one `--resume` could continue from)."""
    root = checkpoints_root(run_dir)
    return root.is_dir() and bool(complete_checkpoints(root))


def check_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool, model: ModelConfig | None = None,
                  checksums: bool | tuple[int, int] = True) -> None:
    """Raise CheckpointError unless a run may start in `run_dir` as asked (the launcher calls it before
    starting ranks, so a refusal is one line, once). A fresh run must not silently replace an earlier run's
    checkpoints: it needs `overwrite`; `resume` needs a complete checkpoint (`resume_checkpoint`) that is
    intact (`verify_checkpoint`: its checksums, computed here once for every rank), whose meta.json and
    rank files parse and, given `model`, that was trained with that model config."""
    if resume and overwrite:
        raise CheckpointError("--resume continues the run in train.run_dir and --overwrite replaces it; pass one")
    root = checkpoints_root(run_dir)
    if resume:
        path = resume_checkpoint(run_dir)[0]
        verify_checkpoint(path, checksums=checksums, resume=True)
        meta = read_meta(path, resume=True)
        if model is not None:
            check_model_config(meta["config"].get("model") or {}, model, where=f"{path} ({META})")
        for r in range(int(meta["world_size"])):  # every rank's file parses (small files), not just this one's
            read_rank_file(path / f"rank_{r:05d}.json")
        return
    own = [p.name for p in meshlm_entries(root)]
    foreign = sorted(p.name for p in root.iterdir() if p.name not in own) if root.is_dir() else []
    if foreign:  # --overwrite deletes only what meshlm wrote: refused rather than left beside a new run
        raise CheckpointError(f"{root} holds files meshlm did not write ({', '.join(foreign[:4])}"
                              f"{' ...' if len(foreign) > 4 else ''}): move them out of it (meshlm deletes only its "
                              "step_N directories and latest), or choose another train.run_dir")
    if own and not overwrite:
        complete = complete_checkpoints(root)
        if complete:
            raise CheckpointError(f"train.run_dir={str(run_dir)!r} holds the checkpoints of an earlier run (newest: "
                                  f"{complete[-1].name}); pass --resume to continue it, --overwrite to replace it, "
                                  "or choose another train.run_dir")
        raise CheckpointError(f"train.run_dir={str(run_dir)!r} holds what an earlier run left in {root.name}/ (no "
                              f"complete checkpoint: {', '.join(sorted(own)[:3])}); pass --overwrite to replace it, "
                              "or choose another train.run_dir")


def meshlm_entries(root: Path) -> list[Path]:
    """What meshlm writes in a run's checkpoints/ folder (what --overwrite deletes, and nothing else): step_N
    directories (also step_N.tmp of a save cut short and step_N.old of a re-save), the `latest` pointer and
    its temporary file."""
    own = re.compile(r"step_\d+(\.tmp|\.old)?|latest(\.tmp)?")
    return sorted(p for p in root.iterdir() if own.fullmatch(p.name)) if root.is_dir() else []


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory, its `checkpoints/` folder, or the checkpoint itself."""
    path = Path(path)
    if (path / META).exists() or (path / MANIFEST).exists():
        return path
    for run_dir in (path, path.parent if path.name == "checkpoints" else None):
        if run_dir is not None and checkpoints_root(run_dir).is_dir():
            found = latest_checkpoint(run_dir)
            if found is not None:
                return found
            root = checkpoints_root(run_dir)
            _, problem = _read_pointer(root)
            incomplete = sorted(p.name for p in root.glob("step_*"))
            if incomplete or (root / "latest").exists():
                raise CheckpointError(f"{problem}, and {root} holds no complete checkpoint (none with "
                                      f"{MANIFEST}: {', '.join(incomplete[:4]) or 'no step_N at all'}); the "
                                      "run never finished a save: train it again (--overwrite)")
    raise CheckpointError(f"no checkpoint at {str(path)!r}: expected a run directory (with checkpoints/latest), "
                          f"its checkpoints/ folder, or a step_N checkpoint directory (with {META})")


def other_checkpoint_hint(path: Path, *, resume: bool = False) -> str:
    """The fix for a damaged checkpoint: the newest earlier one that is intact (every file checked against
    its manifest, checksums included: a hint never points at a damaged checkpoint), if any. `resume`: the
    fix `--resume` takes (write it into `latest`); else a reader's (generate, eval, convert): pass its path."""
    older = [p for p in complete_checkpoints(path.parent) if _step_of(p) < _step_of(path)] \
        if re.fullmatch(r"step_\d+", path.name) else []
    intact = newest_intact(older)
    if intact is not None and resume:
        return f"resume from {intact.name} instead (write {intact.name} into {path.parent / 'latest'})"
    if intact is not None:
        return f"use the earlier checkpoint {intact} instead (intact)"
    if resume:
        return "no intact earlier checkpoint is left: start afresh (--overwrite) or restore the file from a copy"
    return "no intact earlier checkpoint is left: restore the file from a copy (or train the run again)"


def newest_intact(checkpoints: list[Path]) -> Path | None:
    """The newest of `checkpoints` (oldest first) whose every file matches its manifest, checksums included,
    and whose meta.json parses: the only kind a fix may name. Reads them: for error paths only."""
    return next((p for p in reversed(checkpoints)
                 if _files_problem(p, checksums=True)[1] is None and _meta_problem(p) is None), None)


def describe_files(paths: list[Path]) -> dict[str, list]:
    """{file name: [size, sha256]}: what the manifest records of each file."""
    return {p.name: [p.stat().st_size, sha256_file(p)] for p in paths}


def verify_checkpoint(path: str | Path, *, checksums: bool | tuple[int, int] = True, resume: bool = False) -> dict:
    """Check every file of checkpoint `path` against its manifest (present, size, and with `checksums` its
    sha256) and that every rank's file is there; return the manifest. Raises CheckpointError naming the first
    bad file and the fix (`resume`: the fix for `--resume`, else for a reader). `checksums=False` is for a
    caller that verified them already (reading a large checkpoint once per check costs what reading it
    costs): the trainer checks the run_dir first. `checksums=(part, parts)` hashes only every parts-th file
    from the part-th (sorted by name): the ranks of a job share the reading and combine their verdicts.

    Run before anything of the checkpoint is parsed. Checksums protect against damage, not against a crafted
    checkpoint: nothing read from one runs code (inference reads safetensors and JSON only; resuming reads
    DCP's pickled `.metadata` with an unpickler that admits only DCP's metadata classes, `safe_read.py`)."""
    path = Path(path)
    manifest, problem = _files_problem(path, checksums=checksums)
    if problem is not None:
        raise CheckpointError(f"{problem}; {other_checkpoint_hint(path, resume=resume)}")
    return manifest


def _files_problem(path: Path, *, checksums: bool | tuple[int, int]) -> tuple[dict | None, str | None]:
    """(the manifest, None) when every file of `path` matches it; else (None, what is wrong, naming the file)."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return None, (f"{manifest_file} is missing: the checkpoint was never completely published (a crash during "
                      "its save?)")
    try:
        manifest = json.loads(manifest_file.read_text())
        files, world_size = manifest["files"], int(manifest["world_size"])
        files = {str(name): (int(size), str(digest)) for name, (size, digest) in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, f"{manifest_file} is corrupt (not the manifest JSON meshlm writes)"
    for name in files:
        if Path(name).name != name or name in (".", ".."):  # a manifest names files of its own directory only
            return None, f"{manifest_file} is corrupt (it names {name!r}, not a file of the checkpoint)"
    for name in (META, *(f"rank_{r:05d}.json" for r in range(world_size))):
        if name not in files:
            return None, f"{manifest_file} lists no {name} (it was saved by {world_size} ranks)"
    for name, (size, digest) in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return None, f"{f} is missing"
        if f.stat().st_size != size:
            return None, f"{f} has {f.stat().st_size} bytes, the manifest {size} (truncated or overwritten)"
    names = sorted(files)
    if isinstance(checksums, tuple):
        part, parts = checksums
        names = names[part::parts]
    for name in names if checksums is not False else []:
        if sha256_file(path / name) != files[name][1]:
            return None, f"{path / name} does not match its checksum in {MANIFEST} (corrupt)"
    return manifest, None


def saved_layout(path: str | Path, *, checksums: bool = True) -> ParallelDims:
    """The parallel degrees checkpoint `path` was saved under (its config, resolved against its ranks).

    The first thing a resume reads of a checkpoint: verified against its manifest first."""
    verify_checkpoint(path, checksums=checksums, resume=True)
    meta = read_meta(path, resume=True)
    try:
        parallel = config_from_dict(meta["config"]).parallel
        return ParallelDims.from_config(parallel).resolve(int(meta["world_size"]))
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{Path(path) / META} holds a parallel layout this meshlm cannot read ({e}); "
                              f"{other_checkpoint_hint(Path(path), resume=True)}") from None


def read_meta(path: str | Path, *, resume: bool = False) -> dict:
    """meta.json of checkpoint `path` (format, step, world_size, config); CheckpointError if it is unusable
    (`resume`: naming the fix for `--resume`). Callers verify the checkpoint first: this only parses."""
    path = Path(path)
    if not (path / META).exists():
        raise CheckpointError(f"{str(path)!r} is not a checkpoint (no {META}); pass a step_N directory "
                              "or a run directory")
    problem = _meta_problem(path)
    if problem is not None:
        raise CheckpointError(f"{problem}; {other_checkpoint_hint(path, resume=resume)}")
    return json.loads((path / META).read_text())


def _meta_problem(path: Path) -> str | None:
    """What is wrong with meta.json of checkpoint `path` (naming it and, for an old format, the fix); None if usable."""
    meta_file = path / META
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"{meta_file} is corrupt ({one_line(e)})"
    if not isinstance(meta, dict):
        return f"{meta_file} is corrupt (not a JSON object)"
    if meta.get("format") not in _READABLE_FORMATS:
        return (f"{meta_file} has format {meta.get('format')!r}; this meshlm reads formats "
                f"{list(_READABLE_FORMATS)} (an older checkpoint: use the meshlm that wrote it, or train "
                "afresh)")
    lacking = sorted({"config", "step", "world_size"} - set(meta))
    if lacking or not isinstance(meta["config"], dict) or not isinstance(meta["step"], int):
        what = f"lacks {', '.join(lacking)}" if lacking else "has a config that is not an object or a step that " \
            "is not a whole number"
        return f"{meta_file} is corrupt ({what})"
    return None


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line (DCP and JSON errors can span many)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def config_from_dict(d: dict) -> Config:
    """Rebuild a `Config` from `Config.to_dict()` (as stored in a checkpoint), not re-validating data paths."""
    def pick(cls, values):
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in (values or {}).items() if k in names})

    return Config(model=pick(ModelConfig, d.get("model")), parallel=pick(ParallelConfig, d.get("parallel")),
                  train=pick(TrainConfig, d.get("train")), data=pick(DataConfig, d.get("data")))


def check_model_config(saved: dict, current: ModelConfig, *, where: str) -> None:
    """Raise ValueError naming every model field whose value differs from the checkpoint's."""
    now = json.loads(json.dumps(current.__dict__))
    keys = [k for k in sorted(set(saved) | set(now)) if k != "preset" and saved.get(k) != now.get(k)]
    if keys:
        diffs = "; ".join(f"model.{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys)
        sets = " ".join(f"--set model.{k}={json.dumps(saved.get(k))}" for k in keys[:3])
        raise CheckpointError(f"checkpoint {where} was trained with a different model config ({diffs}); use the "
                              f"checkpoint's model settings ({sets}{' ...' if len(keys) > 3 else ''}) or start "
                              "a new run_dir")


def peer_failed(e: BaseException) -> bool:
    """Whether a collective DCP load failed because another rank went away (gloo/NCCL lost the peer)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        s in text for s in ("closed by peer", "reset by peer", "remote worker", "connection refused", "nccl"))


def read_rank_file(rank_file: Path) -> dict:
    """A rank's extras: plain JSON data (nothing in a rank file runs code)."""
    try:
        rank_extra = json.loads(rank_file.read_text())
        if not isinstance(rank_extra, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{rank_file} is not the JSON meshlm writes ({one_line(e, 80)}); "
                              f"{other_checkpoint_hint(rank_file.parent, resume=True)}") from None
    return rank_extra
