"""The mesh has no hole: every layout of up to 8 ranks whose numbers divide runs (issue: every production
layout), and the planner proposes only layouts the runtime runs.

For the `tiny` and `tiny-moe` presets (seq 64, global batch 8, micro-batch 2) every combination of
(dp_replicate, dp_shard, tp, pp, cp, ep, zero_stage) is enumerated (`verify.all_layouts`, what
`meshlm verify --all-layouts` runs). The layouts `check_layout` accepts are exactly those whose sizes
divide, written out here independently of the runtime's checks: a refusal for anything else (a
combination "not implemented") fails the test.
"""

import copy
import io

import pytest

from meshlm import verify
from meshlm.config import load_config

PRESETS = {"tiny": [], "tiny-moe": ["model.preset=tiny-moe"]}


def cfg_of(preset: str):
    return load_config(None, [*PRESETS[preset], *verify.ALL_LAYOUTS_DEFAULTS])


def divides(layout: dict, world: int, cfg) -> bool:
    """What must divide, and nothing else: the arithmetic of the degrees against the model and the batch."""
    m, t = cfg.model, cfg.train
    tp, cp, pp, ep = layout["tp"], layout["cp"], layout["pp"], layout["ep"]
    dp = layout["dp_replicate"] * layout["dp_shard"]
    sizes = (m.num_heads, m.num_kv_heads, m.vocab_size, m.intermediate_size)
    return (all(s % tp == 0 for s in sizes)
            and (cp == 1 or t.seq_len % (2 * cp) == 0)
            and (tp == 1 or (t.seq_len // cp) % tp == 0)  # sequence parallelism (on by default)
            and (ep == 1 or (m.num_experts % ep == 0 and (layout["dp_shard"] * cp) % ep == 0))
            and t.global_batch_size % (dp * t.micro_batch_size) == 0
            and m.num_layers >= pp)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_layout_whose_numbers_divide_is_accepted(preset):
    cfg = cfg_of(preset)
    accepted, refused = verify.all_layouts(cfg, max_ranks=8)
    assert not [r for r in refused if "not implemented" in r], refused
    worlds = {(w, tuple(d.values())) for w, d in accepted}
    # every accepted layout divides, and every combination that divides was accepted
    assert all(divides(d, w, cfg) for w, d in accepted)
    everything = _combinations(cfg)
    missing = [(w, d) for w, d in everything if divides(d, w, cfg) and (w, tuple(d.values())) not in worlds]
    assert not missing, missing[:5]
    # the production layouts are among them
    def has(**kw):
        return any(all(d[k] == v for k, v in kw.items()) for _, d in accepted)
    assert has(pp=2, zero_stage=3) and has(pp=2, tp=2, zero_stage=3)
    if preset == "tiny-moe":
        assert has(ep=2, tp=2) and has(ep=2, cp=2) and has(cp=2, tp=2, ep=2) and has(ep=2, pp=2, zero_stage=3)


def _combinations(cfg):
    experts = cfg.model.num_experts if cfg.model.is_moe else 1
    out = []
    for world in range(2, 9):
        divs = [d for d in range(1, world + 1) if world % d == 0]
        for r in divs:
            for tp in divs:
                for pp in divs:
                    for cp in divs:
                        if world % (r * tp * pp * cp):
                            continue
                        for ep in [e for e in range(1, experts + 1) if experts % e == 0 and e <= world]:
                            for z in range(4):
                                out.append((world, dict(dp_replicate=r, dp_shard=world // (r * tp * pp * cp), tp=tp,
                                                        pp=pp, cp=cp, ep=ep, zero_stage=z)))
    return out


def test_all_layouts_prints_a_line_per_layout_and_a_summary():
    """`meshlm verify --all-layouts --sample 2` (ranks started by the test harness)."""
    from runs import harness_launch

    out = io.StringIO()
    code = verify.main_all_layouts(cfg_of("tiny-moe"), max_ranks=4, sample=2, seed=1, steps=2, launch=harness_launch,
                                   out=out, log=io.StringIO())
    text = out.getvalue()
    assert code == 0, text
    lines = [line for line in text.splitlines() if " ranks  " in line]
    assert len(lines) == 2 and all("MATCH" in line for line in lines), text
    assert "summary: 2 verified: 2 MATCH, 0 MISMATCH, 0 failed" in text


def _planner_layout(d: dict, cfg):
    from meshlm.planner.layout import Layout

    return Layout(**d, micro_batch_size=cfg.train.micro_batch_size, sequence_parallel=cfg.parallel.sequence_parallel)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_planner_accepts_and_prices_exactly_what_the_runtime_accepts(preset):
    """One definition (`meshlm.rules`): for every combination, the planner's `validate_layout` and the
    runtime's `check_layout` agree, and every accepted layout gets an estimate."""
    from meshlm.parallel.parallelize import check_layout
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.cost import Job, ModelSummary, estimate_layout, validate_layout

    cfg = cfg_of(preset)
    job = Job(seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size, runtime="meshlm",
              precision="fp32")
    summary, cluster = ModelSummary.build(cfg.model, job.seq_len), get_cluster("h100")
    disagree, priced = [], 0
    for world, d in _combinations(cfg):
        layout_cfg = verify.with_degrees(cfg, d)
        verdicts = []
        for check in (lambda: check_layout(layout_cfg, world),
                      lambda: validate_layout(cfg.model, job, _planner_layout(d, cfg), gpus=world)):
            try:
                check()
                verdicts.append(None)
            except ValueError as e:
                verdicts.append(str(e))
        if (verdicts[0] is None) != (verdicts[1] is None):
            disagree.append((world, d, verdicts))
        elif verdicts[0] is None:
            m = validate_layout(cfg.model, job, _planner_layout(d, cfg), gpus=world)
            est = estimate_layout(summary, cluster, job, _planner_layout(d, cfg), num_microbatches=m)
            assert est.time_s["step"] > 0 and est.memory_gib["total"] > 0
            priced += 1
    assert not disagree, disagree[:3]
    assert priced > 150


def test_the_planner_search_proposes_only_layouts_the_runtime_runs():
    """Every candidate the search estimates -- every cp method and the hybrid, pp x ZeRO-3 both ways,
    interleaved and zero-bubble schedules, ep -- passes `check_layout` as a config for `meshlm train`."""
    from meshlm.parallel.parallelize import check_layout
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.cost import Job
    from meshlm.planner.search import candidate_layouts

    seen = set()
    for preset in PRESETS:
        long = [*PRESETS[preset], "model.max_seq_len=8192", "train.seq_len=4096", "train.global_batch_size=8"]
        base = load_config(None, long)
        job = Job(seq_len=4096, global_batch_size=8, runtime="meshlm", precision="fp32")
        loaded = {}  # micro-batch size -> its config, loaded (and validated) once: thousands of candidates
        for gpus in (2, 4, 8):
            for lo, _ in candidate_layouts(base.model, get_cluster("h100"), job, gpus):
                m = lo.micro_batch_size
                if m not in loaded:
                    loaded[m] = load_config(None, [*long, f"train.micro_batch_size={m}"])
                cfg = copy.deepcopy(loaded[m])
                for key in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "cp_method", "cp_ulysses", "ep",
                            "zero_stage", "pp_schedule", "pp_chunks", "sequence_parallel",
                            "zero3_reshard_after_forward"):
                    setattr(cfg.parallel, key, getattr(lo, key))
                check_layout(cfg, gpus)  # raises for a layout the runtime refuses
                seen.add((lo.cp_method, lo.cp_ulysses > 1, lo.pp > 1 and lo.zero_stage == 3, lo.ep > 1))
    assert {("ulysses", False), ("allgather", False), ("ring", True)} <= {(m, h) for m, h, _, _ in seen}
    assert any(z for _, _, z, _ in seen) and any(e for _, _, _, e in seen)
