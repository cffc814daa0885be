"""Typed configuration: model, parallel layout, training, data; TOML files and dotted overrides.

Responsible for: the dataclasses every other module reads, model presets, loading a TOML file,
applying `section.field=value` overrides, and rejecting unknown keys or invalid values with a
`ConfigError` that names the field, the value and the rule.
Not responsible for: checking a layout against a world size (that needs the world size; see
`mesh.py`), translating Hugging Face's `config.json` (`meshlm.hf_config`, to which `ModelConfig.from_hf`,
`from_hf_dict` and `to_hf_dict` delegate), or anything that touches torch.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from meshlm.dims import ParallelDims
from meshlm.presets import MODEL_PRESETS
from meshlm.rules import CP_METHODS, FAULT_TOLERANCE, PP_SCHEDULES, RECOMPUTE_MODES, REPLICA_OUTER, ZERO_STAGES
from meshlm.values import is_finite_real, is_integer, is_whole_number


class ConfigError(ValueError):
    """A user mistake in a configuration: the message names the field, the value and the fix."""


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Dimensions of a Llama-style decoder, dense or Mixture-of-Experts.

    Field names follow Hugging Face where one exists. `num_experts == 0` means dense everywhere;
    otherwise layers `first_dense_layers..` (every `moe_layer_freq`-th) use MoE.
    """

    preset: str | None = None
    vocab_size: int = 256
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 768
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # RoPE scaling, Hugging Face's keys: Llama 3's {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, or "rope_type" "yarn" / "linear" with theirs; None for plain RoPE.
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # lm_head shares the embedding weight (under pp: two copies kept equal, pipeline.py)
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    # Mixture of Experts
    num_experts: int = 0
    num_experts_per_token: int = 2
    moe_intermediate_size: int | None = None  # None: intermediate_size
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None  # total width of the shared expert(s)
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert output (Qwen2-MoE)
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    first_dense_layers: int = 0  # leading layers that stay dense (DeepSeek)
    moe_layer_freq: int = 1  # every n-th layer after those is MoE
    router_aux_loss_coef: float = 0.01
    # Tokens per expert per rank capped at ceil(capacity_factor * tokens * top_k / num_experts); the
    # overflow (lowest router weight first) is dropped. 0.0: dropless (every routed token is processed).
    capacity_factor: float = 0.0
    # Aux-loss-free balancing (DeepSeek-V3): after each optimizer step a per-expert selection bias
    # moves by this much towards balance (`meshlm.parallel.expert.update_router_biases`). 0.0: off.
    router_bias_update_rate: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim is None and is_integer(self.hidden_size) and is_integer(self.num_heads) and self.num_heads > 0:
            self.head_dim = self.hidden_size // self.num_heads  # else validate() names the value

    # -- derived ------------------------------------------------------------------------------
    @property
    def rope_type(self) -> str | None:
        """The RoPE scaling's kind (llama3 where the table does not say: Llama 3's, as configs saved before), or
        None for plain RoPE."""
        return None if self.rope_scaling is None else self.rope_scaling.get("rope_type", "llama3")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def shared_intermediate_size(self) -> int:
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.num_shared_experts * self.expert_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        if not self.is_moe or layer < self.first_dense_layers:
            return False
        return (layer - self.first_dense_layers) % self.moe_layer_freq == 0

    def validate(self) -> None:
        positive = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "max_seq_len", "head_dim"]
        for name in positive:
            value = getattr(self, name)
            _require(is_integer(value), f"model.{name}", value, "must be a whole number")
            _require(value > 0, f"model.{name}", value, "must be > 0")
        for name in ("num_experts", "num_experts_per_token", "moe_layer_freq", "first_dense_layers",
                     "num_shared_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)  # counts (the None ones: unset)
            _require(value is None and name.endswith("intermediate_size") or is_integer(value), f"model.{name}", value,
                     "must be a whole number")
        for name in ("rope_theta", "norm_eps", "init_std", "router_aux_loss_coef", "capacity_factor",
                     "router_bias_update_rate"):
            value = getattr(self, name)  # an inf or nan would reach the weights or the router as such
            _require(is_finite_real(value), f"model.{name}", value, "must be a finite number")
        _require(self.hidden_size % self.num_heads == 0 or self.head_dim != self.hidden_size // self.num_heads,
                 "model.num_heads", self.num_heads,
                 f"must divide model.hidden_size={self.hidden_size} (or set model.head_dim)")
        _require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
                 f"must divide model.num_heads={self.num_heads} (grouped-query attention)")
        _require(self.head_dim % 2 == 0, "model.head_dim", self.head_dim, "must be even (RoPE rotates pairs)")
        _require(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        _require(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        _require(self.num_experts >= 0, "model.num_experts", self.num_experts, "must be >= 0 (0 = dense)")
        if self.is_moe:
            _require(1 <= self.num_experts_per_token <= self.num_experts, "model.num_experts_per_token",
                     self.num_experts_per_token, f"must be in 1..model.num_experts={self.num_experts}")
            _require(self.moe_layer_freq >= 1, "model.moe_layer_freq", self.moe_layer_freq, "must be >= 1")
            _require(0 <= self.first_dense_layers <= self.num_layers, "model.first_dense_layers",
                     self.first_dense_layers, f"must be in 0..model.num_layers={self.num_layers}")
            _require(self.moe_intermediate_size is None or self.moe_intermediate_size > 0,
                     "model.moe_intermediate_size", self.moe_intermediate_size,
                     "must be > 0 (each expert's width), or unset for intermediate_size")
            _require(self.num_shared_experts >= 0, "model.num_shared_experts", self.num_shared_experts,
                     "must be >= 0 (0 = none)")
            _require(self.shared_expert_intermediate_size is None or self.shared_expert_intermediate_size > 0,
                     "model.shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                     "must be > 0 (the shared experts' total width), or unset")
        _require(self.init_std >= 0, "model.init_std", self.init_std, "must be >= 0 (the initial weights' std)")
        _require(self.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", self.router_aux_loss_coef,
                 "must be >= 0 (0 = no load-balancing loss)")
        _require(self.capacity_factor >= 0, "model.capacity_factor", self.capacity_factor,
                 "must be >= 0 (0 = dropless; e.g. 1.25 caps each expert at 1.25x its even share)")
        _require(self.router_bias_update_rate >= 0, "model.router_bias_update_rate", self.router_bias_update_rate,
                 "must be >= 0 (0 = off; DeepSeek-V3 uses 1e-3)")
        if self.rope_scaling is not None:
            _require(isinstance(self.rope_scaling, dict), "model.rope_scaling", self.rope_scaling,
                     "must be a table of RoPE scaling keys (llama3, yarn or linear), or unset")
            kind = self.rope_type
            _require(kind in ROPE_SCALING_KEYS, "model.rope_scaling", self.rope_scaling,
                     f"has rope_type {kind!r}, which must be one of {', '.join(ROPE_SCALING_KEYS)}")
            missing = ROPE_SCALING_KEYS[kind] - set(self.rope_scaling)
            _require(not missing, "model.rope_scaling", self.rope_scaling, f"is missing keys {sorted(missing)}")
            factor = self.rope_scaling["factor"]
            _require(is_finite_real(factor) and factor > 0, "model.rope_scaling", self.rope_scaling,
                     "has a factor that is not a number > 0")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ConfigError(f"model.preset={name!r} is unknown; choose one of {sorted(MODEL_PRESETS)}")
        cfg = cls(preset=name, **{**MODEL_PRESETS[name], **overrides})
        return cfg

    # -- Hugging Face config.json (meshlm.hf_config) -------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path) -> "ModelConfig":
        """Read a Hugging Face `config.json` (file or the directory holding it)."""
        from meshlm.hf_config import read_hf_config

        return read_hf_config(path)

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        """The model a Hugging Face `config.json`'s contents describe (ConfigError: what is not supported)."""
        from meshlm.hf_config import model_config_from_hf

        return model_config_from_hf(hf)

    def to_hf_dict(self) -> dict:
        """The Hugging Face `config.json` of this model (the inverse of `from_hf_dict`)."""
        from meshlm.hf_config import hf_config_of

        return hf_config_of(self)


# each RoPE scaling's required keys (Hugging Face's names; yarn may add attention_factor, beta_fast, beta_slow,
# mscale, mscale_all_dim, truncate): models/transformer.rope_inv_freq applies them
ROPE_SCALING_KEYS = {"llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
                     "yarn": {"factor", "original_max_position_embeddings"}, "linear": {"factor"}}
# --------------------------------------------------------------------------------------------
# Parallel layout, training, data
# --------------------------------------------------------------------------------------------



def zero3_reshards(reshard_after_forward: bool | None, pp: int) -> bool:
    """parallel.zero3_reshard_after_forward resolved: unset is false under a pipeline (pp > 1), true
    otherwise -- the one rule the runtime (`parallelize`) and the planner (`planner.memory`) both apply."""
    return pp == 1 if reshard_after_forward is None else reshard_after_forward


@dataclass
class ParallelConfig(ParallelDims):
    """Degrees of each parallelism and their knobs. `dp_shard = -1` takes what the others leave."""

    # The degrees (dp_replicate, dp_shard, tp, pp, cp, ep) are `meshlm.dims.ParallelDims`' fields.

    # ring (K/V blocks passed around the cp ranks) | allgather (K/V gathered once per layer) | ulysses (all-to-all
    # to split the attention by heads instead of tokens; num_heads / tp must divide by cp)
    cp_method: str = "ring"
    # > 1: the hybrid (USP) with cp_method=ring -- Ulysses all-to-alls within groups of this many consecutive cp
    # ranks (it must divide cp, and the heads per tp rank), the ring across the groups; 1: the method alone
    cp_ulysses: int = 1
    # 0: plain DDP over dp_shard; 1/2/3: ZeRO over dp_shard (with or without tp and pp)
    zero_stage: int = 0
    # ZeRO-3 (FSDP2's reshard_after_forward): true frees a block's gathered parameters after each micro-batch's
    # forward and gathers them again for its backward (least memory, 2 all-gathers per unit and micro-batch);
    # false gathers each unit once per step and keeps it until the step's gradient reduction (the stage's
    # whole parameters full, 1 all-gather per unit and step). Unset: false with pp > 1, true otherwise
    # (torchtitan's default: per-micro-batch gathers under a pipeline cost more than they save)
    zero3_reshard_after_forward: bool | None = None
    sequence_parallel: bool = True  # with tp > 1: the residual stream split along the sequence over tp
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero_bubble
    pp_chunks: int = 1  # virtual stages per rank (interleaved)
    num_microbatches: int = 0  # pipeline microbatches; 0: derived from the batch
    pp_layers: str = ""  # blocks per pipeline stage, stage order (pp x pp_chunks counts), e.g. "5,3"; "": cost-balanced (schedules.balanced_split)
    bucket_size_mb: float = 25.0  # gradients reduced in buckets of this size, overlapped with backward
    recompute: str = "none"  # none | selective | full
    # A collective that has not completed after this long (a peer rank stopped, died or diverged) raises an
    # error naming the rank, the op and the mesh axis, and the job fails (or restarts, --max-restarts).
    collective_timeout_s: float = 600.0
    # On GPUs (NCCL): "stream" queues each collective on the device and the host runs ahead; one that never
    # completes is caught by the step watchdog (2 x collective_timeout_s), which names the silent rank. "blocking":
    # the host waits for every collective, up to collective_timeout_s, and the first one that does not complete
    # raises the error (rank, op, mesh axis, silent rank) at once -- slower (no run-ahead), for finding a hang.
    # Gloo always waits (both settings act the same on CPU).
    collective_wait: str = "stream"
    # Stragglers: each rank notes how long it worked alone before each step's first collective (since its
    # previous collective ended, when every rank was even); a rank that took this many times the median of
    # the others of its pipeline stage (and 50 ms more) for straggler_steps steps in a row is named in a
    # warning line. metrics.jsonl carries every step's arrival_spread_s and slowest_rank. 0: no warning
    straggler_factor: float = 2.0
    straggler_steps: int = 5
    # none | replica: the data-parallel replicas are torchft replica groups (`meshlm.train.replica`), each its own
    # launcher job (`meshlm train --replica-groups N` starts them all here): a group that fails drops out of the
    # per-step quorum while the others step on, and rejoins by copying the model and optimizer from a live group.
    # Inside a group: plain data parallelism (dp_shard, zero_stage 0) and tp; dp_replicate stays 1
    fault_tolerance: str = "none"
    replica_groups: int = 1  # N: each global batch is cut into N slices, one per group (an absent group's is skipped)
    replica_group: int = 0  # this job's group, 0..N-1 (`--replica-groups` sets it); its run_dir is run_dir/replica_<i>
    lighthouse: str = ""  # the torchft lighthouse, http://HOST:PORT (`--replica-groups` starts one and sets it)
    min_replica_groups: int = 1  # a step commits only with at least this many groups in its quorum
    replica_start_wait_s: float = 60.0  # a group's first quorum waits this long for all N groups to join it
    # 1: gradients averaged over the live groups every step; H > 1: semi-synchronous (slow links between groups):
    # each group steps on its own slice and every H steps the groups synchronise (a quorum, then replica_outer)
    replica_sync_every: int = 1
    # with replica_sync_every > 1: average (torchft's LocalSGD: the weights averaged) | diloco (torchft's DiLoCo: the
    # moves since the last sync averaged, applied by an outer SGD with Nesterov momentum)
    replica_outer: str = "average"
    replica_outer_lr: float = 0.7  # DiLoCo's outer learning rate (the paper's 0.7)
    replica_outer_momentum: float = 0.9  # DiLoCo's outer Nesterov momentum (the paper's 0.9)

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep", "pp_chunks", "cp_ulysses"):
            _require(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "must be >= 1")
        _require(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard,
                 "must be >= 1, or -1 to take what the other degrees leave of the world size")
        _require(self.zero_stage in ZERO_STAGES, "parallel.zero_stage", self.zero_stage,
                 f"must be one of {list(ZERO_STAGES)}")
        _require(self.zero3_reshard_after_forward is None or isinstance(self.zero3_reshard_after_forward, bool),
                 "parallel.zero3_reshard_after_forward", self.zero3_reshard_after_forward,
                 "must be true, false or unset (false with pp > 1, true otherwise)")
        _require(self.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", self.pp_schedule,
                 f"must be one of {list(PP_SCHEDULES)}")
        _require(self.num_microbatches >= 0, "parallel.num_microbatches", self.num_microbatches,
                 "must be >= 0 (0 = derived)")
        _require(self.bucket_size_mb > 0, "parallel.bucket_size_mb", self.bucket_size_mb, "must be > 0")
        _require(all(p.strip().isdigit() and int(p) >= 1 for p in self.pp_layers.split(",")) if self.pp_layers
                 else True, "parallel.pp_layers", self.pp_layers,
                 'must be comma-separated block counts >= 1, one per stage (e.g. "5,3"), or "" for the cost-balanced default')
        _require(self.recompute in RECOMPUTE_MODES, "parallel.recompute", self.recompute,
                 f"must be one of {list(RECOMPUTE_MODES)}")
        _require(self.cp_method in CP_METHODS, "parallel.cp_method", self.cp_method,
                 f"must be one of {list(CP_METHODS)}")
        _require(self.collective_timeout_s > 0, "parallel.collective_timeout_s", self.collective_timeout_s,
                 "must be > 0 seconds")
        _require(self.collective_wait in ("stream", "blocking"), "parallel.collective_wait", self.collective_wait,
                 'must be "stream" (the host runs ahead) or "blocking" (every collective waited for, to find a hang)')
        _require(self.straggler_factor == 0 or self.straggler_factor > 1, "parallel.straggler_factor",
                 self.straggler_factor, "must be > 1 (times the median rank's time), or 0 for no warning")
        _require(self.straggler_steps >= 1, "parallel.straggler_steps", self.straggler_steps,
                 "must be >= 1 (consecutive steps before a rank is named)")
        _require(self.fault_tolerance in FAULT_TOLERANCE, "parallel.fault_tolerance", self.fault_tolerance,
                 f"must be one of {list(FAULT_TOLERANCE)}")
        _require(self.replica_outer in REPLICA_OUTER, "parallel.replica_outer", self.replica_outer,
                 f"must be one of {list(REPLICA_OUTER)}")
        _require(self.replica_outer_lr > 0, "parallel.replica_outer_lr", self.replica_outer_lr, "must be > 0")
        _require(0 <= self.replica_outer_momentum < 1, "parallel.replica_outer_momentum", self.replica_outer_momentum,
                 "must be in [0, 1)")
        for name in ("replica_groups", "min_replica_groups", "replica_sync_every"):
            _require(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "must be >= 1")
        _require(self.replica_start_wait_s >= 0, "parallel.replica_start_wait_s", self.replica_start_wait_s,
                 "must be >= 0 seconds")
        _require(0 <= self.replica_group < self.replica_groups, "parallel.replica_group", self.replica_group,
                 f"must be in 0..parallel.replica_groups-1={self.replica_groups - 1}")


@dataclass
class TrainConfig:
    # The defaults are the CPU demo (`meshlm train`, configs/tiny.toml): tiny on the stdlib corpus;
    # README.md's quick tour shows what it prints and the runs that chose seq_len, batch and lr.
    steps: int = 150  # optimizer steps
    epochs: float = 0.0  # if > 0: passes over the training set, setting train.steps once the data is read
    seq_len: int = 128  # tokens per sample
    global_batch_size: int = 32  # sequences per optimizer step, over all data-parallel ranks
    global_batch_tokens: int = 0  # if > 0, overrides global_batch_size (= tokens // seq_len)
    # sequences per forward/backward on one rank; 0: the whole per-rank batch (global_batch_size /
    # data-parallel degree, no accumulation), so the defaults run on any dp dividing the batch
    micro_batch_size: int = 0
    lr: float = 1.2e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # the schedule ends at lr x this
    lr_schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 15  # linear warm-up from 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp64 (parity proofs)
    device: str = "auto"  # auto | cpu | cuda
    run_dir: str = "runs/default"  # metrics.jsonl, checkpoints/ (and TensorBoard files) go here
    checkpoint_interval: int = 0  # steps; 0: only at the end
    # Stage each checkpoint in CPU memory and write it in the background while training goes on; the next
    # save (and the end of training) waits for it, then publishes it. The last one is written synchronously.
    async_checkpoint: bool = False
    keep_checkpoints: int = 2  # the newest ones kept on disk
    # In-memory checkpoints: every this many steps each rank copies its pieces to host memory (files in
    # memory_checkpoint_dir, a tmpfs: they outlive the ranks, not the machine) and to one peer's (on another
    # node when there is one); after the launcher restarts the ranks (--max-restarts) they resume from the
    # newest copy that survived when it is at least as new as the newest checkpoint on storage. 0: off
    memory_checkpoint_interval: int = 0
    memory_checkpoint_dir: str = "/dev/shm"
    log_interval: int = 1  # steps between metrics rows
    val_interval: int = 50  # steps between validation losses
    val_batches: int = 4  # global batches of the validation split per validation (one pass at most); 0: none
    peak_tflops: float = 0.0  # per device, for MFU; 0: known GPUs from a table, none on CPU (MFU not shown)
    sample_tokens: int = 120  # generated at the end of `meshlm train`
    progress: bool = True  # a progress bar; false: one plain line per logged step
    # on a CPU device: raise glibc malloc's mmap/trim thresholds for this process so each step reuses the
    # memory the last one freed instead of faulting fresh pages in (meshlm/host_memory.py; ~10% on the demo)
    reuse_host_memory: bool = True
    # TensorBoard event files next to metrics.jsonl (`tensorboard --logdir runs`); needs the [tb] extra
    tensorboard: bool = False
    wandb: bool = False  # also log to an offline Weights & Biases run in <run_dir>/wandb; needs wandb installed

    def validate(self) -> None:
        for name in ("steps", "seq_len", "global_batch_size", "log_interval", "val_interval", "keep_checkpoints"):
            _require(getattr(self, name) >= 1, f"train.{name}", getattr(self, name), "must be >= 1")
        for name in ("micro_batch_size", "warmup_steps", "checkpoint_interval", "memory_checkpoint_interval",
                     "val_batches", "global_batch_tokens", "weight_decay", "grad_clip", "sample_tokens", "peak_tflops"):
            _require(getattr(self, name) >= 0, f"train.{name}", getattr(self, name), "must be >= 0")
        _require(self.epochs >= 0, "train.epochs", self.epochs, "must be >= 0 (0: train.steps decides)")
        _require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1/beta2",
                 (self.beta1, self.beta2), "must be in [0, 1)")
        _require(self.lr_schedule in ("cosine", "linear", "constant"), "train.lr_schedule",
                 self.lr_schedule, "must be cosine, linear or constant")
        _require(self.precision in ("auto", "fp32", "bf16", "fp64"), "train.precision", self.precision,
                 "must be auto, fp32, bf16 or fp64")
        _require(self.device in ("auto", "cpu", "cuda"), "train.device", self.device, "must be auto, cpu or cuda")
        if self.global_batch_tokens:
            _require(self.global_batch_tokens % self.seq_len == 0, "train.global_batch_tokens",
                     self.global_batch_tokens, f"must be a multiple of train.seq_len={self.seq_len}")
            self.global_batch_size = self.global_batch_tokens // self.seq_len


@dataclass
class DataConfig:
    # A text file, a folder of text files, a .jsonl of texts or of conversations ({"messages": [...]}: chat
    # fine-tuning, see assistant_only_loss), or a folder `meshlm data prepare` wrote (token shards, memory-mapped:
    # nothing is read into memory); empty: the embedded default (Python stdlib sources)
    path: str = ""
    # Prepared folders mixed by weight instead of data.path, the same mix on any number of ranks, e.g.
    # [{path = "data/web", weight = 0.7}, {path = "data/code", weight = 0.3}]
    sources: list = field(default_factory=list)
    tokenizer: str = ""  # tokenizer.json or its model folder (a chat template for conversations); empty: bytes
    val_fraction: float = 0.02  # share of the documents held out for validation (prepared data: its 'val' split)
    max_bytes: int = 8_000_000  # cap on the text read (the default corpus is large; prepared data: no cap)
    # attention stops at document boundaries inside a packed sample (block-causal), and RoPE positions restart
    # at 0 at each document's start; false: each token sees every earlier token of its sample
    document_mask: bool = False
    # conversations ({"messages": [...]} lines rendered by the chat template, or a folder prepared from them): the
    # loss counts only the assistant's turns (each reply and what closes it); false: every token
    assistant_only_loss: bool = True
    # conversations: one that does not fit in the rest of a sample starts the next (the rest padded, no loss on it),
    # so none is cut from its beginning; true: packed back to back and split across samples like texts
    split_across_samples: bool = False

    @property
    def prepared(self) -> bool:  # whether training reads token shards `meshlm data prepare` wrote
        return bool(self.sources) or is_prepared(self.path)

    @property
    def folders(self) -> list[str]:  # the prepared folders training reads: data.sources' paths, or data.path
        return [str(entry["path"]) for entry in self.sources] if self.sources else [self.path]

    def validate(self) -> None:
        _require(0 <= self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in [0, 1)")
        _require(self.max_bytes > 0, "data.max_bytes", self.max_bytes, "must be > 0")
        if self.path:
            _require(Path(self.path).exists(), "data.path", self.path, "must be an existing file or folder")
        if self.tokenizer:
            _require(Path(self.tokenizer).exists(), "data.tokenizer", self.tokenizer,
                     "must be an existing tokenizer.json or its folder (or empty for bytes)")
        if self.sources:
            _require(not self.path, "data.path", self.path, "must be empty when data.sources mixes prepared folders")
            for i, entry in enumerate(self.sources):
                ok = isinstance(entry, dict) and set(entry) == {"path", "weight"}
                _require(ok, f"data.sources[{i}]", entry, 'must be {path = "DIR", weight = W}')
                _require(is_prepared(entry["path"]), f"data.sources[{i}].path", entry["path"],
                         "must be a folder `meshlm data prepare` wrote (it holds manifest.json)")
                w = entry["weight"]
                _require(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0,
                         f"data.sources[{i}].weight", w, "must be a number > 0")
        if self.prepared and not self.tokenizer:
            first = self.folders[0]
            named = json.loads((Path(first) / "manifest.json").read_text()).get("tokenizer", {}).get("path", "?")
            raise ConfigError(f"data.tokenizer is empty but {first} holds prepared tokens; set data.tokenizer to the "
                              f"tokenizer.json it was prepared with ({named})")


def is_prepared(path: str) -> bool:
    """A folder `meshlm data prepare` wrote: it holds manifest.json."""
    return bool(path) and (Path(path) / "manifest.json").is_file()


@dataclass
class Config:
    model: ModelConfig = field(default_factory=lambda: ModelConfig.from_preset("tiny"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> "Config":
        self.model.validate()
        self.parallel.validate()
        self.train.validate()
        self.data.validate()
        _require(self.train.seq_len <= self.model.max_seq_len, "train.seq_len", self.train.seq_len,
                 f"must be <= model.max_seq_len={self.model.max_seq_len}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------------

_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated `Config` from an optional TOML file and `section.field=value` overrides.

    `model.preset` is applied first (from the file or an override), then every other model field,
    so `--set model.preset=llama3-8b --set model.num_layers=2` means a 2-layer Llama-3-8B.
    """
    raw: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if isinstance(overrides, str) or not all(isinstance(item, str) for item in overrides):
        raise ConfigError(f"overrides={overrides!r} must be a list of 'section.field=value' strings")
    if path is not None:
        if str(path) == "":  # Path("") is the working directory
            raise ConfigError("config file '' is empty: give a TOML file, or None for the defaults")
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config key {section!r} must be a [section] table, e.g. [train] then steps = 1")
            if section not in _SECTIONS:
                raise ConfigError(f"unknown config section [{section}]; valid sections: {sorted(_SECTIONS)}")
            for key, value in values.items():
                _check_key(section, key)
                raw[section][key] = value
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r} must look like section.field=value (e.g. train.lr=3e-4)")
        section, name = key.strip().split(".", 1)
        _check_key(section, name)
        raw[section][name] = _parse_value(_SECTIONS[section], name, text.strip())

    model_raw = dict(raw["model"])
    preset = model_raw.pop("preset", "tiny")
    if preset:
        model = ModelConfig.from_preset(preset)
    else:
        model = ModelConfig()
    for key, value in model_raw.items():
        setattr(model, key, _coerce(ModelConfig, key, value))
    if "head_dim" not in model_raw and ("hidden_size" in model_raw or "num_heads" in model_raw) and preset:
        model.head_dim = model.hidden_size // model.num_heads if model.num_heads > 0 else 0
    cfg = Config(model=model,
                 parallel=ParallelConfig(**{k: _coerce(ParallelConfig, k, v) for k, v in raw["parallel"].items()}),
                 train=TrainConfig(**{k: _coerce(TrainConfig, k, v) for k, v in raw["train"].items()}),
                 data=DataConfig(**{k: _coerce(DataConfig, k, v) for k, v in raw["data"].items()}))
    return cfg.validate()


def _check_key(section: str, key: str) -> None:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown config section {section!r}; valid sections: {sorted(_SECTIONS)}")
    names = [f.name for f in fields(_SECTIONS[section])]
    if key not in names:
        raise ConfigError(f"unknown key {section}.{key}; valid keys in [{section}]: {', '.join(names)}")


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _parse_value(cls: type, name: str, text: str) -> Any:
    """Parse an override's text by the field's declared type (TOML syntax accepted too)."""
    tp = _field_type(cls, name)
    base = _base_type(tp)
    if base is str:
        return text.strip('"').strip("'")
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if base is bool and text.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return text.lower() in ("true", "yes", "on", "1")
        hint = {dict: " (a TOML inline table: {factor = 8.0, low_freq_factor = 1.0}, not JSON)",
                list: " (a TOML array: [\"a\", \"b\"])"}.get(base, "")
        raise ConfigError(f"{_section_of(cls)}.{name}={text!r} is not a valid {base.__name__}{hint}") from None


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return args[0]
    return tp


def _section_of(cls: type) -> str:
    return next(k for k, v in _SECTIONS.items() if v is cls)


def _coerce(cls: type, name: str, value: Any) -> Any:
    tp = _field_type(cls, name)
    base = _base_type(tp)
    if value is None and type(None) in typing.get_args(tp):
        return None
    where = f"{_section_of(cls)}.{name}"
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be true or false")
    if base is int:
        if not is_whole_number(value):
            raise ConfigError(f"{where}={value!r} must be an integer")
        return int(value)
    if base is float:
        if not is_finite_real(value):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    for kind, word in ((list, "a list"), (dict, "a table")):
        if (typing.get_origin(base) or base) is kind and not isinstance(value, kind):
            raise ConfigError(f"{where}={value!r} must be {word}")
    return value


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} {rule}")
