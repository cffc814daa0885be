"""The one definition of every parallel setting: its allowed values, and every refusal of a layout.

Responsible for: the names a setting may take (`PP_SCHEDULES`, `CP_METHODS`, `RECOMPUTE_MODES`,
`ZERO_STAGES`; `config.ParallelConfig.validate`, the strategies and the planner read them from here), and
`check_layout_numbers`: every reason a layout of resolved degrees cannot run a model at a sequence length
and batch -- sizes tensor parallelism does not divide, sequences context or sequence parallelism cannot
split, heads Ulysses cannot split, experts expert parallelism cannot spread, stages the pipeline cannot
fill, batches the data-parallel ranks cannot share, a capacity factor on a split micro-batch -- each a
ValueError naming the value and the fix. The runtime (`parallel.parallelize.check_layout`, before any rank
starts) and the planner (`planner.layout.validate_layout`, and so its search) both call it, so the planner
proposes only what the runtime runs and prices everything it runs (tests/test_layouts.py enumerates both).
Torch-free.
Not responsible for: the degrees against the world size (`dims.ParallelDims.resolve`), settings only the
runtime has (`parallel.pp_layers`, checked by `parallelize.pp_layers`) or only the planner has (Megatron-Core's
runs: expert_tp, ep_comm_overlap; `planner.layout`).
"""

from __future__ import annotations

import math

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
# ring: K/V blocks passed around the cp ranks; allgather: K/V gathered once per layer; ulysses: all-to-all
# from tokens to heads and back (`meshlm.parallel.context`)
CP_METHODS = ("ring", "allgather", "ulysses")
RECOMPUTE_MODES = ("none", "selective", "full")  # `meshlm.parallel.recompute`
ZERO_STAGES = (0, 1, 2, 3)  # 0: plain data parallelism (`meshlm.parallel.data`); 1-3: `meshlm.parallel.zero`
# none | replica: torchft replica groups over the data-parallel replicas (`meshlm.train.replica`)
FAULT_TOLERANCE = ("none", "replica")
# what replica groups do every parallel.replica_sync_every > 1 steps: torchft's LocalSGD (average) or DiLoCo
REPLICA_OUTER = ("average", "diloco")


def _choices(n: int, start: int = 1) -> str:
    return ",".join(str(d) for d in range(start, n + 1) if n % d == 0) or "none"


def check_tensor_parallel(model, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise ValueError naming the first model size that `tp` does not divide, and the fix; and for a
    capacity factor under sequence parallelism (MoE layers then see a part of each micro-batch's tokens)."""
    if tp == 1:
        return
    divisible = [("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                 ("vocab_size", model.vocab_size), ("intermediate_size", model.intermediate_size)]
    for name, value in divisible:
        if value % tp != 0:
            raise ValueError(f"model.{name}={value} is not divisible by tp={tp} (tensor parallelism "
                             f"splits it evenly over the tp ranks); choose tp among the divisors "
                             f"{{{_choices(value)}}} of {value} (it must also divide the other sizes), "
                             f"or change model.{name} to a multiple of {tp}")
    if model.is_moe and sequence_parallel and model.capacity_factor > 0:
        raise ValueError(f"model.capacity_factor={model.capacity_factor} with tensor parallelism and sequence "
                         "parallelism is not implemented: each tp rank's MoE layers see only its part of the "
                         "sequence, and the capacity is a share of the whole micro-batch's tokens; set "
                         "model.capacity_factor=0 (dropless) or parallel.sequence_parallel=false")


def check_seq_len(seq_len: int, cp: int) -> None:
    """Raise ValueError unless `seq_len` splits into 2*cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        lower = max(2 * cp, seq_len // (2 * cp) * 2 * cp)
        raise ValueError(f"train.seq_len={seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (context "
                         f"parallelism cuts every sequence into 2*cp chunks, two per rank, to balance the causal "
                         f"work); set train.seq_len to a multiple of {2 * cp} (e.g. {lower} or {lower + 2 * cp}), "
                         "or change parallel.cp")


def ulysses_kv_heads(kv_heads: int, cp: int) -> int:
    """The kv heads Ulysses spreads over `cp` ranks: lcm(kv_heads, cp) (kv heads replicated where cp exceeds them)."""
    return math.lcm(kv_heads, cp)


def check_ulysses(num_heads: int, num_kv_heads: int, *, cp: int, tp: int = 1, hybrid: bool = False) -> None:
    """Raise ValueError unless Ulysses can split the heads of one tp rank over `cp` ranks (`hybrid`: `cp` is
    parallel.cp_ulysses, the ranks of one all-to-all group)."""
    if cp == 1:
        return
    heads = num_heads // tp
    if heads % cp:
        per = "" if tp == 1 else f" / parallel.tp={tp} = {heads} per tp rank"
        setting, other = (("parallel.cp_ulysses", "parallel.cp_ulysses=1") if hybrid else
                          ("parallel.cp", "parallel.cp_method=ring or allgather"))
        raise ValueError(f"{'' if hybrid else 'parallel.cp_method=ulysses, '}{setting}={cp} with model.num_heads="
                         f"{num_heads}{per}: the heads are not divisible by {cp} (Ulysses splits every tp rank's "
                         f"attention heads over its all-to-all ranks); choose {setting} in "
                         f"{{{_choices(heads, 2)}}}, or {other}")
    # the kv heads are replicated to lcm(kv, cp), which always divides the query heads once cp and kv do
    assert heads % ulysses_kv_heads(num_kv_heads // tp, cp) == 0


def check_hybrid(cp: int, ulysses: int, method: str) -> None:
    """Raise ValueError unless parallel.cp_ulysses=`ulysses` can split `cp` (the hybrid runs the ring)."""
    if ulysses == 1:
        return
    if ulysses < 1 or cp % ulysses:
        raise ValueError(f"parallel.cp_ulysses={ulysses} does not divide parallel.cp={cp} (the cp ranks form "
                         f"groups of cp_ulysses for the all-to-alls, a ring across the groups); choose it in "
                         f"{{{_choices(cp)}}}")
    if method != "ring":
        raise ValueError(f"parallel.cp_ulysses={ulysses} with parallel.cp_method={method!r}: the hybrid is Ulysses "
                         "within groups of cp_ulysses ranks and the ring across them; set parallel.cp_method=ring, "
                         "or parallel.cp_ulysses=1")


def check_context_parallel(model, cp: int, *, seq_len: int, tp: int, sequence_parallel: bool,
                           method: str = "ring", ulysses: int = 1) -> None:
    """Raise ValueError unless `cp` context-parallel ranks can split sequences of `seq_len` of `model`."""
    if cp == 1:
        return
    check_seq_len(seq_len, cp)
    check_hybrid(cp, ulysses, method)
    if method == "ulysses" or ulysses > 1:
        hybrid = method != "ulysses"
        check_ulysses(model.num_heads, model.num_kv_heads, cp=ulysses if hybrid else cp, tp=tp, hybrid=hybrid)
    if model.is_moe and model.capacity_factor > 0:
        raise ValueError(f"model.capacity_factor={model.capacity_factor} with parallel.cp={cp} is not "
                         "implemented: each cp rank's MoE layers see only its chunks of the sequence, and the "
                         "capacity is a share of the whole micro-batch's tokens; set model.capacity_factor=0 "
                         "(dropless) or parallel.cp=1")
    if tp > 1 and sequence_parallel and (seq_len // cp) % tp:
        raise ValueError(f"train.seq_len / parallel.cp = {seq_len // cp} tokens per rank is not divisible by "
                         f"parallel.tp={tp} (sequence parallelism splits them over the tp ranks); set "
                         f"train.seq_len to a multiple of {math.lcm(2 * cp, cp * tp)}, or "
                         "parallel.sequence_parallel=false")


def check_expert_parallel(model, ep: int) -> None:
    """Raise ValueError unless the experts of `model` split over `ep` ranks (where the ep groups come from:
    `check_ep_groups`, which `dims.ParallelDims.resolve` calls with the degrees)."""
    if ep == 1:
        return
    if not model.is_moe:
        raise ValueError(f"parallel.ep={ep} needs a Mixture-of-Experts model (model.num_experts > 0, e.g. "
                         "model.preset=tiny-moe); set parallel.ep=1 for a dense model")
    if model.num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide model.num_experts={model.num_experts} (each ep rank "
                         f"holds num_experts / ep experts); choose ep in {{{_choices(model.num_experts)}}}")


def check_ep_groups(ep: int, *, dp_shard: int, cp: int) -> None:
    """Raise ValueError unless ep groups of `ep` ranks tile the dp_shard x cp ranks they are carved from."""
    shard_cp = dp_shard * cp
    if not isinstance(ep, int) or ep < 1 or shard_cp % ep:
        raise ValueError(f"parallel.ep={ep} does not divide dp_shard x cp = {dp_shard} x {cp} = {shard_cp} (experts "
                         f"are spread over the data-shard and context ranks); choose ep in {{{_choices(shard_cp)}}}")


def check_pipeline_model(model, num_stages: int) -> None:
    """Raise ValueError for a model a pipeline cannot split over `num_stages` stages."""
    if model.num_layers < num_stages:
        raise ValueError(f"model.num_layers={model.num_layers} must be >= parallel.pp x parallel.pp_chunks = "
                         f"{num_stages} (every stage runs at least one block)")


def check_schedule(name: str, pp: int, num_microbatches: int, pp_chunks: int) -> None:
    """Raise ValueError unless schedule `name` can order `num_microbatches` over `pp` ranks x `pp_chunks`."""
    if name not in PP_SCHEDULES:
        raise ValueError(f"pp_schedule={name!r} must be one of {list(PP_SCHEDULES)}")
    if pp < 1 or num_microbatches < 1 or pp_chunks < 1:
        raise ValueError(f"pp={pp}, num_microbatches={num_microbatches}, pp_chunks={pp_chunks} must all be >= 1")
    if pp_chunks > 1 and name != "interleaved":
        raise ValueError(f"pp_chunks={pp_chunks} needs pp_schedule='interleaved' (or set pp_chunks=1)")
    if name == "interleaved" and num_microbatches % pp:
        raise ValueError(f"interleaved 1F1B needs num_microbatches={num_microbatches} divisible by pp={pp} "
                         "(Megatron's order runs microbatches in groups of pp); change either")


def check_batch(global_batch_size: int, *, dp: int, micro_batch_size: int) -> None:
    """Raise ValueError unless `dp` ranks share `global_batch_size` sequences in whole micro-batches
    (`micro_batch_size` 0: each rank's whole share at once, so only dp must divide)."""
    per_step = dp * (micro_batch_size or 1)
    if global_batch_size % per_step:
        lower = max(per_step, global_batch_size // per_step * per_step)
        if micro_batch_size:
            divisor = f"data-parallel degree x train.micro_batch_size = {dp} x {micro_batch_size} = {per_step}"
            other = "train.micro_batch_size or the number of ranks"
        else:
            divisor, other = f"the data-parallel degree {dp}", "the number of ranks"
        raise ValueError(
            f"train.global_batch_size={global_batch_size} is not divisible by {divisor} (each of the "
            f"{dp} data-parallel ranks runs whole micro-batches); set train.global_batch_size to a "
            f"multiple of {per_step} (e.g. {lower} or {lower + per_step}), or change {other}")


def check_layout_numbers(model, *, dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, ep: int,
                         zero_stage: int, sequence_parallel: bool, cp_method: str, cp_ulysses: int,
                         pp_schedule: str, pp_chunks: int, seq_len: int, global_batch_size: int,
                         micro_batch_size: int, num_microbatches: int = 0) -> int:
    """Every refusal of a layout of resolved degrees for `model` at `seq_len` and `global_batch_size`
    (`micro_batch_size` 0: each data-parallel rank's whole share; `num_microbatches` 0: derived), as a
    ValueError naming the value and the fix; returns the micro-batches per data-parallel rank and step."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"parallel.zero_stage={zero_stage} must be one of {list(ZERO_STAGES)}")
    if cp_method not in CP_METHODS:
        raise ValueError(f"parallel.cp_method={cp_method!r} must be one of {list(CP_METHODS)}")
    if pp > 1:
        check_pipeline_model(model, pp * pp_chunks)
    check_tensor_parallel(model, tp, sequence_parallel=sequence_parallel)
    check_context_parallel(model, cp, seq_len=seq_len, tp=tp, sequence_parallel=sequence_parallel,
                           method=cp_method, ulysses=cp_ulysses)
    check_expert_parallel(model, ep)
    if tp > 1 and sequence_parallel and seq_len % tp:
        raise ValueError(f"train.seq_len={seq_len} is not divisible by parallel.tp={tp} (sequence "
                         "parallelism splits every sequence over the tp ranks); set train.seq_len to a multiple "
                         f"of {tp}, or parallel.sequence_parallel=false")
    dp = dp_replicate * dp_shard
    check_batch(global_batch_size, dp=dp, micro_batch_size=micro_batch_size)
    per_rank = global_batch_size // dp
    if micro_batch_size:
        m = per_rank // micro_batch_size
    elif pp > 1 and num_microbatches:
        if per_rank % num_microbatches:
            raise ValueError(f"parallel.num_microbatches={num_microbatches} does not divide the per-rank batch "
                             f"train.global_batch_size / dp = {per_rank}; change either")
        m = num_microbatches
    else:
        m = 1
    if pp > 1:
        if num_microbatches and num_microbatches != m:
            raise ValueError(f"parallel.num_microbatches={num_microbatches} disagrees with the batch: "
                             f"train.global_batch_size / (dp x train.micro_batch_size) = {m}; set it to {m} or 0")
        check_schedule(pp_schedule, pp, m, pp_chunks)
    elif pp_chunks > 1 and pp_schedule != "interleaved":
        raise ValueError(f"pp_chunks={pp_chunks} needs pp_schedule='interleaved' (or set pp_chunks=1)")
    return m


def check_replica_groups(model, *, replica_groups: int, dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int,
                         ep: int, zero_stage: int, global_batch_size: int, micro_batch_size: int) -> None:
    """Raise ValueError (one line) for a layout inside a torchft replica group that `meshlm.train.replica` does
    not run: it averages whole per-rank gradients over the groups, so a group may hold plain data parallelism
    and tp, nothing that shards gradients or optimizer state over data ranks or splits the step into stages;
    and the global batch must cut into the groups' slices."""
    refused = [(dp_replicate > 1, f"parallel.dp_replicate={dp_replicate}: the replica groups are the replicas; "
                                  "set dp_replicate=1 and the number of groups with --replica-groups N"),
               (pp > 1, f"parallel.pp={pp}"), (cp > 1, f"parallel.cp={cp}"), (ep > 1, f"parallel.ep={ep}"),
               (getattr(model, "is_moe", False), "a mixture-of-experts model"),
               (zero_stage > 0, f"parallel.zero_stage={zero_stage}")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"parallel.fault_tolerance=replica runs plain data parallelism and tp inside a replica "
                             f"group, not {what}")
    ranks = replica_groups * dp_shard
    if global_batch_size % ranks or (global_batch_size // ranks) % micro_batch_size:
        raise ValueError(f"train.global_batch_size={global_batch_size} must split into {replica_groups} replica "
                         f"group(s) x {dp_shard} data rank(s) x micro-batches of {micro_batch_size}; "
                         f"use a multiple of {ranks * micro_batch_size}")
