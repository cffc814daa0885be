"""The planner's inputs from what a user types: sizes like 4M, amounts like 15T, a model preset or config.json, a Job.

Responsible for: parsing sizes and amounts, resolving a model spec, building and validating a `Job`, the default
runtime of a cluster, and the failure/power figures of one estimate from the command's flags.
Not responsible for: the command line itself (`meshlm.cli.plan`) or any estimate.
"""

from __future__ import annotations

import math

from pathlib import Path

_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}
_DECIMAL = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def _with_unit(text: str | float, units: dict) -> float | None:
    """`text` as a number times the multiplier of its one-letter unit suffix (`units`); None if not a number."""
    t = str(text).strip().lower()
    mult = 1
    if t and t[-1] in units:
        mult, t = units[t[-1]], t[:-1]
    try:
        return float(t) * mult
    except ValueError:
        return None


def parse_size(text: str | int) -> int:
    """`4M` -> 4 * 2**20 (token batches are powers of two by custom), `512` -> 512, `1.5K` -> 1536."""
    if isinstance(text, int):
        return text
    value = _with_unit(text, _UNITS)
    if value is None:
        raise ValueError(f"size {text!r} is not a number like 4096, 4M or 16M (K/M/G = 2^10/2^20/2^30)")
    if value < 1 or not float(value).is_integer():
        raise ValueError(f"size {text!r} must be a positive whole number")
    return int(value)


def parse_amount(text: str | float | None, *, flag: str) -> float | None:
    """`15T` -> 1.5e13, `500G` -> 5e11, `2e12` -> 2e12 (decimal units: token counts, bytes per second)."""
    if text is None:
        return None
    value = _with_unit(text, _DECIMAL)
    if value is None:
        raise ValueError(f"{flag} {text!r} is not a number like 15T, 500G or 2e12 "
                         "(K/M/G/T = 1e3/1e6/1e9/1e12)")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {text!r} must be a finite number > 0")
    return value


def runtime_of(args) -> str:
    """--runtime, or its default: meshlm's own runtime on --cluster local (this machine runs meshlm), else megatron."""
    if getattr(args, "runtime", None):
        return args.runtime
    return "meshlm" if args.cluster == "local" else "megatron"


def job_operations(est, cfg, cluster, args) -> dict:
    """Failures / checkpoint / goodput (every recovery path) and power of one estimate, with the command's flags."""
    from meshlm.planner.mla import total_params
    from meshlm.planner.operations import FAILURE_RATE_PER_GPU_HOUR, RESTART_S, operations

    rate = FAILURE_RATE_PER_GPU_HOUR if getattr(args, "failure_rate", None) is None else args.failure_rate
    restart = RESTART_S if getattr(args, "restart_s", None) is None else args.restart_s
    return operations(est, cluster, total_params=total_params(cfg, runtime_of(args)), precision=args.precision,
                      failure_rate_per_gpu_hour=rate,
                      storage_bw=parse_amount(getattr(args, "storage_bw", None), flag="--storage-bw"),
                      train_tokens=parse_amount(getattr(args, "train_tokens", None), flag="--train-tokens"),
                      recovery=getattr(args, "recovery", "storage"),
                      replica_groups=getattr(args, "replica_groups", None),
                      restart_s=restart, replica_sync_every=getattr(args, "replica_sync_every", 1))


def resolve_model(spec: str):
    """A preset name, or a Hugging Face config.json (or the directory holding one): the model types meshlm builds as
    `ModelConfig.from_hf` reads them; a DeepSeek-style one (`kv_lora_rank`) as `mla.LatentConfig`, its latent
    attention beside the body the serving planner reads (`serving_model.served_model`); gpt-oss and Gemma 2 / 3 as
    the serving planner reads their shapes (their sliding windows left out: the training side prices full
    attention)."""
    from meshlm.config import MODEL_PRESETS, ModelConfig

    if spec in MODEL_PRESETS:
        return ModelConfig.from_preset(spec)
    if spec.endswith(".json") or Path(spec).is_dir():
        from meshlm.planner.serving_model import config_json, planner_only

        hf = config_json(spec)
        read = planner_only(hf) if hf is not None else None
        return read.cfg if read is not None else ModelConfig.from_hf(spec)
    raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(sorted(MODEL_PRESETS))}) "
                     "nor a Hugging Face config.json / model directory")


def make_job(*, seq_len: int, global_batch_size: int | None = None, global_batch_tokens: int | str | None = None,
             precision: str = "bf16", flash_attention: bool = True, runtime: str = "megatron", **options):
    """The training `Job` of these sizes; `options`: its other fields as given (e.g. ep_dispatcher)."""
    from meshlm.planner.cost import Job

    if seq_len is None or int(seq_len) < 1:
        raise ValueError(f"--seq-len={seq_len} must be >= 1")
    if global_batch_tokens:
        tokens = parse_size(global_batch_tokens)
        if tokens % seq_len:
            raise ValueError(f"--global-batch-tokens={global_batch_tokens} ({tokens}) must be a multiple of "
                             f"--seq-len={seq_len}")
        gbs = tokens // seq_len
    elif global_batch_size:
        gbs = parse_size(global_batch_size)
    else:
        raise ValueError("give --global-batch-size (sequences) or --global-batch-tokens (e.g. 4M)")
    job = Job(seq_len=int(seq_len), global_batch_size=gbs, precision=precision, flash_attention=flash_attention,
              runtime=runtime, **options)
    job.validate()
    return job
