"""What a row of a published table says, read from its cells as the tables word them: the model it trained (`model_of`,
`ARCHS` for shapes a row leaves blank), the cluster it ran on (`cluster_for`), its software stack (`stack_of`), its
ZeRO stage, precision, recomputation, sequence, pipeline schedule and sharding group.

Responsible for: turning one cell, or a row's text, into the planner's word for it, the same way for every table:
a row is read by what it says, never by the group id the CSV gives it, so that another table in these columns (a
held-out one) is read as benchmarks/data/'s rows are; a cell no reader can make sense of raises ValueError /
LookupError, which `published.predict_row` turns into a skip with the reason.
Not responsible for: the job and layouts those readings make, or pricing them (`published.py`, whose module docstring
lists the choices and their sources), or the serving tables (`published_serving.py`, which shares `name_key` and
`read_table`: a column a table lacks, or a cell a short line leaves out, reads as blank), or naming the software
stacks and what each runs (`published_stacks.py`, whose `stack_of` this module reads the stack with).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

from meshlm.config import ModelConfig
from meshlm.models import stats as model_stats
from meshlm.planner.cluster import Cluster, get_cluster, with_overrides
from meshlm.planner.mla import latent_attention
from meshlm.planner.published_stacks import PYTORCH_FSDP_STACKS, stack_of

_GPT = dict(mlp="gelu")  # 4h MLP, mapped to SwiGLU of the same FLOPs
# Architectures the CSV leaves blank, from the papers / model cards (keys: name prefixes, compared by `name_key`).
ARCHS = {
    # NeMo GPT-3 configs (Brown et al. 2020 Table 2.1 sizes); vocab padded as Megatron does.
    "gpt3-5b": dict(layers=24, hidden=4096, heads=32, ffn=16384, vocab=51200, **_GPT),
    "gpt3-20b": dict(layers=44, hidden=6144, heads=48, ffn=24576, vocab=51200, **_GPT),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, ffn=49152, vocab=51200, **_GPT),
    # Touvron et al. 2023 (Llama 2) Table 1 / model cards.
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000),
    "llama2-13b": dict(layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
    "llama 2 13b": dict(layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000),
    "llama 2 70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
    # Nemotron-3 8B / Nemotron-4 (Parmar et al. 2024 Table 1; NVIDIA 2024 Nemotron-4 340B report): squared ReLU MLP.
    "nemotron-8b": dict(layers=32, hidden=4096, heads=32, ffn=16384, vocab=256000, untied=True, **_GPT),
    "nemotron-22b": dict(layers=40, hidden=6144, heads=48, kv_heads=8, ffn=24576, vocab=256000, untied=True, **_GPT),
    "nemotron-340b": dict(layers=96, hidden=18432, heads=96, kv_heads=8, ffn=73728, vocab=256000, untied=True, **_GPT),
    # OpenAI gpt-oss model card (2025): 36 layers, 128 experts top-4, head_dim 64.
    "gpt oss 120b": dict(layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64, ffn=2880, vocab=201088,
                         experts=128, top_k=4, moe_ffn=2880),
    # Qwen3 technical report (2025) Table 2 / config.json.
    "qwen3_30b_a3b": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, vocab=151936,
                          experts=128, top_k=8, moe_ffn=768, qk_norm=True),
    # MosaicML MPT (llm-foundry's yamls/pretrain/mpt-*.yaml; the CSV rows carry the sizes): GeLU 4h MLP.
    "mpt-": dict(**_GPT),
    # BigScience BLOOM (tr11-176B-ml README, the CSV row carries the sizes): GeLU 4h MLP.
    "bloom": dict(**_GPT),
    # Ai2 OLMo-core (OLMo-1124 shapes: olmo_core/nn/transformer/config.py olmo_1B / olmo_7B / olmo_13B, qk_norm=True;
    # the CSV rows carry the sizes).
    "olmo-1124": dict(qk_norm=True),
    "qwen3_235b_a22b": dict(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, ffn=12288, vocab=151936,
                            experts=128, top_k=8, moe_ffn=1536, qk_norm=True),
    # Llama 3 / 3.1 (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: its vocabulary of 128,000 tokens).
    **{f"llama {v} {size}": arch for v in ("3", "3.1") for size, arch in (
        ("8b", dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128000)),
        ("70b", dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128000)),
        ("405b", dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128000)))},
}


def name_key(name: str) -> str:
    """A model name without case, spaces or punctuation: "Llama 3.1 8B", "LLAMA3.1_8B" and "llama-3.1-8b" agree."""
    return re.sub(r"[^a-z0-9]", "", name.lower())

# torchtitan's "selective" activation checkpointing is not Megatron's (attention core only): "selective
# layer" checkpoints every second transformer block in full (its `selective_ac_option = "2"`), "selective
# op" saves the matmul outputs but recomputes every second matmul and the ops between (its `_save_list`
# policy). Both re-run about half of the forward: priced as the mean of the no-recompute and the
# full-recompute estimates (time and memory), the planner having no per-layer recompute choice.
HALF_RECOMPUTE = "half"
# Whole blocks checkpointed in some of the layers (a row's "full, first 10 of 80 layers": YaFSDP's
# `num_layers_to_checkpoint`, Megatron's --recompute-num-layers): the no-recompute and full-recompute estimates
# weighted by the share of the layers, what each layer's forward, re-run or not, and its kept activations add up to.
_PARTIAL = re.compile(r"(\d+) of (\d+) layers")


def recompute_fraction(rc: str) -> float | None:
    """The share of the forward a recompute reading re-runs where it is not one of the planner's modes: 0.5 for
    `HALF_RECOMPUTE`, k / L for "k of L layers", N / 100 for "N% of the forward" (a remat policy whose cell states
    the share it re-runs: `recompute_of`); None for a mode the planner prices itself."""
    if rc == HALF_RECOMPUTE:
        return 0.5
    share = re.fullmatch(r"(\d+)% of the forward", rc)
    if share:
        return int(share.group(1)) / 100
    m = _PARTIAL.fullmatch(rc)
    return int(m.group(1)) / int(m.group(2)) if m else None


def cell_int(text: str, default: int | None = None) -> int | None:
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else default


def cell_float(text: str) -> float | None:
    m = re.match(r"\s*([\d.]+)", text or "")
    return float(m.group(1)) if m else None


class Row(dict):
    """One row of a published table: a column the table does not have reads as blank, as does a cell a short line
    leaves out, so that a table worded or laid out its own way is read, not refused."""

    def __missing__(self, key: str) -> str:
        return ""


def read_table(path: str | Path) -> list[Row]:
    """The rows of a published table (CSV with a header line), blank cells as "" and cells beyond the header dropped."""
    with Path(path).open(newline="") as f:
        return [Row((k, v or "") for k, v in r.items() if k is not None) for r in csv.DictReader(f)]


def predict_each(rows: list[dict], predict, keys: tuple[str, ...]) -> list[dict]:
    """`predict` on every row; a row it fails on comes back as skipped with the error (and the row's `keys`), so that
    no row stops a table (tests call the predictors themselves and see them raise)."""
    out = []
    for row in rows:
        try:
            out.append(predict(row))
        except Exception as e:  # noqa: BLE001 -- reported per row
            out.append({**{k: row.get(k, "") for k in keys}, "skip": f"planner error: {type(e).__name__}: {e}"})
    return out


def row_text(row: dict) -> str:
    return " ".join(str(row.get(k) or "") for k in ("source", "source_loc", "model", "notes", "other_metric")).lower()


def compiled(row: dict) -> bool | None:
    """Whether the row says torch.compile was on (True), off (False), or neither (None)."""
    t = row_text(row)
    if re.search(r"torch\.compile off|compile\s*=\s*false|compile: n\b|(without|no) torch\.compile|not use compile", t):
        return False
    if re.search(r"torch\.compile|compile\s*=\s*true|compile: y\b|--training\.compile\b", t):  # torchtitan's flag
        return True
    return None


def cluster_of(gpu: str) -> str:
    """The cluster preset a published table's GPU cell names (training and serving tables alike)."""
    g = gpu.lower()
    squeezed = re.sub(r"[\s_-]", "", g)  # "RTX PRO 6000", "rtx_pro_6000", "MI-300X" name their part too
    if "a100" in g and re.search(r"(?<![\d.])40\s*gi?b?\b", g):  # "A100 40GB", "A100-SXM4-40GB"; not "400 W"
        return "a100-pcie-40gb" if "pcie" in squeezed else "a100-40gb"
    if "a100" in g and re.search(r"(?<![\d.])64\s*gi?b?\b", g):  # Leonardo's custom part
        return "a100-64gb"
    if "a100" in g and "pcie" in squeezed:
        return "a100-pcie"
    if "l40s" in g:
        return "l40s"
    if re.search(r"(?<![a-z0-9])l4(?![0-9a-z])", g):  # "NVIDIA L4", "L4 24GB"; not L40 / L40S
        return "l4"
    if "h100" in g and re.search(r"hbm2e|2\.4 ?tb/s", g):  # the HBM2e part (cluster.py PRESETS)
        return "h100-hbm2e"
    if "gh200" in squeezed:  # Grace Hopper: 144 GB HBM3e, or the first version's 96 GB HBM3 (whose device name,
        # "NVIDIA GH200 480GB", counts its LPDDR5X)
        return "gh200-96gb" if re.search(r"(?<![\d.])(96|480)\s*gi?b", g) and "144" not in g else "gh200"
    for card in ("h200", "h100"):  # the PCIe-card parts (not Grace Hopper's GH200, an SXM-class module)
        if card in squeezed and "gh200" not in squeezed and ("nvl" in squeezed or "pcie" in squeezed):
            return f"{card}-nvl" if "nvl" in squeezed or card == "h200" else f"{card}-pcie"
    for key, name in (("gb300", "gb300-nvl72"), ("b300", "b300"), ("gb200", "gb200-nvl72"), ("b200", "b200"),
                      ("h200", "h200"), ("h100", "h100"), ("h800", "h800"), ("a800", "a800"), ("a100", "a100"),
                      ("ampere", "a100"), ("mi355x", "mi355x"), ("mi350x", "mi350x"), ("mi325x", "mi325x"),
                      ("mi300x", "mi300x"), ("rtxpro6000", "rtx-pro-6000")):
        if key in squeezed:
            return name
    raise ValueError(f"GPU {gpu!r} has no cluster preset (planner/cluster.py PRESETS)")


def cluster_for(row: dict) -> Cluster:
    """The row's cluster: the GPU's preset, with the row's own scale-out bandwidth per GPU where it gives one
    ("N Gb/s ...") and it differs from the preset's (e.g. fms-fsdp's 800 Gbps per 8-GPU node), and its own number of
    GPUs per scale-up domain where its node cell leads with one that differs ("4 (nodes of 4 H200 on NVLink)"), and
    its own scale-up bandwidth where the node cell gives one per direction ("100 GB/s each way")."""
    cluster = get_cluster(cluster_of(row["gpu"]))
    gbit = _gbit_per_s(row.get("internode_bw_per_gpu", ""))
    if gbit and abs(gbit * 1e9 / 8 - cluster.scaleout_bw) > 1e6:
        cluster = with_overrides(cluster, scaleout_bw=gbit * 1e9 / 8)
    node = cell_int(row.get("node_nvlink", ""))
    if node and node != cluster.scaleup_size:
        cluster = with_overrides(cluster, scaleup_size=node)
    # A node without NVSwitch, its GPUs joined pair by pair ("each pair joined by 4 links, 100 GB/s each way": the
    # 4-GPU A100 board): what one pair of GPUs moves each way, the most a group of two gets.
    pair = re.search(r"(\d+(?:\.\d+)?)\s*GB/s each way", row.get("node_nvlink", ""))
    if pair:
        cluster = with_overrides(cluster, scaleup_bw=float(pair.group(1)) * 1e9)
    return cluster


def token_count(text: str) -> int | None:
    """A token count as tables write it: 16777216, "16,777,216", "16M" (2^20: token batches are powers of two)."""
    m = re.match(r"\s*([\d,]+(?:\.\d+)?)\s*([kmg]?)", text or "", re.IGNORECASE)
    if not m or not m.group(1).replace(",", ""):
        return None
    return int(float(m.group(1).replace(",", "")) * 2 ** {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()])


def _gbit_per_s(text: str) -> float | None:
    """The first figure with a bit-rate unit ("200 Gb/s", "400 Gbps", "3.2 Tbps"), in Gb/s: in "8 x 200 Gb/s" the
    200, not the count of links before it."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([gt])(?:b/s|bps|bit|b\b)", text or "", re.IGNORECASE)
    return float(m.group(1)) * (1000 if m.group(2).lower() == "t" else 1) if m else None


def gpt_style(row: dict) -> bool:
    """A GPT-style model (a 4h GeLU MLP, learned positions) rather than a Llama-style one: its architecture says so, or
    its name has the word GPT (not gpt-oss, nor the trainer litgpt running Llama)."""
    name = row["model"].strip().lower()
    arch = next((a for k, a in ARCHS.items() if name_key(name).startswith(name_key(k))), {})
    return arch.get("mlp") == "gelu" or (re.search(r"\bgpt", name) is not None and "oss" not in name)


def model_of(row: dict) -> ModelConfig:
    name = row["model"].strip().lower()
    if name.startswith("deepseekv3"):
        return ModelConfig.from_preset("deepseek-v3")
    arch = next((a for k, a in ARCHS.items() if name_key(name).startswith(name_key(k))), {})
    get = lambda key, col: cell_int(row[col]) if cell_int(row[col]) else arch.get(key)  # noqa: E731
    hidden, heads, layers = get("hidden", "hidden"), get("heads", "heads"), get("layers", "layers")
    if None in (hidden, heads, layers):
        raise LookupError(f"architecture of {row['model']!r} is neither in the CSV nor in ARCHS")
    ffn = get("ffn", "ffn") or 4 * hidden
    gpt = gpt_style(row)
    # GPT-style models tie their embedding and output head (Megatron-LM's and NeMo's defaults, Paxml's shared softmax,
    # MPT, BLOOM) but GPT-NeoX-20B (configs/20B.yml: no_weight_tying) and Nemotron (`ARCHS`: untied).
    kw = dict(vocab_size=get("vocab", "vocab") or 51200, hidden_size=hidden, num_layers=layers, num_heads=heads,
              num_kv_heads=get("kv_heads", "kv_heads") or heads, max_seq_len=cell_int(row["seq_len"]) or 8192,
              intermediate_size=128 * round(2 * ffn / 3 / 128) if gpt else ffn, qk_norm=arch.get("qk_norm", False),
              tie_embeddings=gpt and not arch.get("untied", "neox" in name))
    if arch.get("head_dim"):
        kw["head_dim"] = arch["head_dim"]
    if arch.get("experts"):
        kw.update(num_experts=arch["experts"], num_experts_per_token=arch["top_k"],
                  moe_intermediate_size=arch["moe_ffn"])
    cfg = ModelConfig(**kw)
    cfg.validate()  # ConfigError (a ValueError) names the size the row gets wrong
    return cfg


def recompute_choices(row: dict) -> list[str]:
    """The recomputation the row ran, or each one it may have run where it says "not stated" (the float8 / FSDP2
    blog: "the best ... activation checkpointing schemes" explored): none, half (the PyTorch stacks' selective
    checkpointing) and full, the planner keeping the fastest that fits, as for a micro-batch size not given."""
    if "not stated" in (row["recompute"] or "").lower():
        return ["none", HALF_RECOMPUTE, "full"] if _pytorch_fsdp(row) else ["none", "selective", "full"]
    return [recompute_of(row)]


def recompute_of(row: dict) -> str:
    t = (row["recompute"] or "").strip().lower()
    if re.match(r"(none|no|off|false|not stated)\b", t):
        return "none"
    share = re.search(r"about (\d+)% of the forward", t)
    if share and 0 < int(share.group(1)) < 100:  # a remat policy re-running the stated share of the forward
        return f"{int(share.group(1))}% of the forward"
    if t.startswith("partial"):  # a remat policy re-running about half the forward (module docstring)
        return HALF_RECOMPUTE
    m = _PARTIAL.search(t)
    if m and 0 < int(m.group(1)) < int(m.group(2)):  # whole blocks in some of the layers
        return f"{int(m.group(1))} of {int(m.group(2))} layers"
    if re.match(r"(yes|on|true)\b", t) or "full" in t:
        return "full"
    if _pytorch_fsdp(row) and ("selective layer" in t or "selective op" in t):
        return HALF_RECOMPUTE
    if "recompute_modules" in t and "core_attn" not in t:
        # Megatron-Core's selective recomputation of named modules other than the attention core: layernorm and
        # moe_act re-run elementwise work only, mlp the dense layers' MLP (DeepSeek-V3's first three layers) -- priced
        # as none, that re-run and what it frees left out; mla_up_proj is priced on its own
        # (`Job.recompute_mla_up_proj`: MLA's q, k, v not kept, its up-projections run again).
        return "none"
    if "selective" in t:
        return "selective"
    if not t and stack_of(row) == "megascale":
        return "selective"
    if "checkpoint" in t or "recomput" in t:  # "activation checkpointing", "recomputation": every block
        return "full"
    return "none"


def recomputes_mla_up_proj(row: dict, cfg: ModelConfig) -> bool:
    """Megatron-Core's recompute_modules "mla_up_proj" (`Job.recompute_mla_up_proj`): where the row's recompute cell
    names it (group AL's cards), or, the cell blank, an NVIDIA recipe of a model with latent attention on H100 or
    GB200 -- Megatron-Bridge's performance script sets DeepSeek-V3's per GPU (scripts/performance/run_script.py at
    f37f883a8, 2025-09-24, "dsv3 2509": ["mla_up_proj", "mlp"] on H100, "moe_act" too on GB200)."""
    cell = (row["recompute"] or "").strip().lower()
    if cell:
        return "mla_up_proj" in cell
    gpu = row.get("gpu", "").lower()
    return (nvidia_recipe(row) and latent_attention(cfg, "megatron") is not None
            and ("h100" in gpu or "gb200" in gpu))


def _pytorch_fsdp(row: dict) -> bool:
    """PyTorch-native FSDP stacks (torchtitan, IBM's fms-fsdp, the float8 / FSDP2 blog's torchtitan runs): their
    "selective" checkpointing re-runs about half the forward (`HALF_RECOMPUTE`)."""
    return stack_of(row) in PYTORCH_FSDP_STACKS


def shard_degree(row: dict) -> int | None:
    """The sharding group a row names: "FSDP=<n>" (the JAX recipes' fsdp mesh axes, ICI x DCN: parameters sharded
    over n, the rest of the data parallelism replicating; "FSDP=0" is NeMo's "no FSDP") or InternLM's "zero1=<n>"
    (optimizer states sharded over n > 1 data-parallel ranks, replicated across the groups; -1: over all of them,
    as DeepSpeed's ZeRO-1); None where it names neither."""
    for key, least in (("fsdp", 1), ("zero1", 2)):
        m = re.search(rf"{key}\s*=\s*(-?\d+)", row["zero_fsdp"], re.IGNORECASE)
        if m and int(m.group(1)) >= least:
            return int(m.group(1))
    return None


def hybrid_shard(row: dict) -> bool:
    """PyTorch FSDP's HYBRID_SHARD ("HSDP"): parameters sharded over the GPUs of a node, replicated across nodes."""
    return "hsdp" in row["zero_fsdp"].lower()


def zero_of(row: dict) -> int:
    """The ZeRO stage the row names: "ZeRO-3", "ZeRO stage 2", "zero1=8", "ZeRO-2-style"; FSDP / HSDP (not "FSDP=0")
    and ZeRO-Infinity / ZeRO++ are 3, Composer's SHARD_GRAD_OP 2; "none" 0; else Megatron's distributed optimizer
    (the NeMo / Megatron-Bridge default), 1."""
    t = row["zero_fsdp"].strip().lower()
    m = re.search(r"zero[\s_-]*(?:stage[\s_-]*)?([0-3])(?!\d)|\bstage[\s_-]*([0-3])\b", t)
    if m:
        return int(m.group(1) or m.group(2))
    if (("fsdp" in t and "fsdp=0" not in t) or hybrid_shard(row)
            or any(k in t for k in ("full_shard", "fully shard", "zero-infinity", "zero++"))):
        return 3
    if "shard_grad_op" in t:
        return 2
    if t in ("none", "no", "ddp", "off"):
        return 0
    return 1  # Megatron's distributed optimizer (NeMo / Megatron-Bridge default)


def precision_of(row: dict) -> str:
    """fp8 where the row names fp8 / float8 (FP8-CS, "fp8 (torchao float8 linear layers ...)", "bf16 + float8"): its
    GEMMs, the rest staying 16-bit; else bf16 (bf16, fp16, "mixed precision (16-bit)": the same tensor-core rate).
    NVIDIA's recipe tables that leave it open are their FP8 tables."""
    t = row["precision"].lower()
    if re.search(r"fp8|float8", t) and not re.search(r"\b(no|without|not)\s+(fp8|float8)", t):
        return "fp8"
    if stack_of(row) == "nemo" and (not t.strip() or "not stated" in t):
        return "fp8"
    return "bf16"


# What a row's memory cell (`mem_gb_per_gpu`) measured, as the row words it, first match wins: PyTorch's caching
# allocator's peak of live tensors (torch.cuda.max_memory_allocated), its peak pool (max_memory_reserved: what
# torchtitan's log line prints as "memory: ... GiB"), or the device's used memory as nvidia-smi / NVML show it
# (the pool with the CUDA context and the communication library's buffers beside it).
MEMORY_MEASURES = (("allocated", r"max_memory_allocated|peak allocated"),
                   ("reserved", r"max_memory_reserved|peak reserved"),
                   ("device", r"nvidia-smi|\bnvml\b"))


def memory_of(row: dict) -> tuple[str, float] | None:
    """(measure, GiB) of the row's memory cell: the measure the row names (`MEMORY_MEASURES`) and the cell's figure
    in GiB -- GB of 10^9 bytes where the row says its figure was divided by 1e9 (Lightning Thunder's benchmark),
    GiB otherwise (torchtitan's and PyTorch's memory reports, nvidia-smi's MiB / 1024). None where the cell is blank
    or the row does not say what it measured (BigScience's "Mem", "max memory used" by an unnamed tool)."""
    figure = cell_float(row.get("mem_gb_per_gpu") or "")
    text = row_text(row) + " " + (row.get("inferred_fields") or "").lower()
    measure = next((name for name, pattern in MEMORY_MEASURES if re.search(pattern, text)), None)
    if not figure or measure is None:
        return None
    gb = re.search(r"/\s*1e9\b", text) is not None
    return measure, figure * (1e9 / 2**30 if gb else 1.0)


def source_year(row: dict) -> int:
    """The latest year the row's source names (2024 when it names none): which release of its stack it ran."""
    return max((int(y) for y in re.findall(r"\b(20\d\d)\b", row.get("source") or "")), default=2024)


def seq_len_of(row: dict) -> int:
    s = cell_int(row["seq_len"])
    if s:
        return s
    # torchtitan's performance.md: Llama 3 runs at 8192, Llama 2 at 4096 (its note on the table)
    return 8192 if "llama 3" in row["model"].lower() else 4096



def nvidia_recipe(row: dict) -> bool:
    """NVIDIA's NeMo / Megatron-Bridge performance recipes."""
    return stack_of(row) == "nemo"


# Pipeline schedules as tables name them (Qi et al.'s "ZB-H1" / "ZB-1p" keep a third of 1F1B's bubble: the planner's
# zero_bubble; its "ZB-2p" / "ZB-V" come closer to none, priced as that third, an upper bound), read from the row's
# own cells (vpp, source_loc, notes, other_metric), not its source: a paper's title names its method for its
# baseline rows too.
_SCHEDULE_NAMES = (("gpipe", "gpipe"), ("zb-", "zero_bubble"), ("zbv", "zero_bubble"), ("zero bubble", "zero_bubble"),
                   ("zero-bubble", "zero_bubble"), ("zerobubble", "zero_bubble"), ("1f1b-i", "interleaved"),
                   ("interleaved", "interleaved"), ("1f1b", "1f1b"))  # torchtitan's names too: ZBVZeroBubble, ...


def schedule_named(row: dict) -> str | None:
    """The pipeline schedule the row's own cells name first (`_SCHEDULE_NAMES`), None when they name none."""
    for col in ("vpp", "source_loc", "notes", "other_metric"):
        t = (row.get(col) or "").lower()
        hits = [(t.find(key), -len(key), name) for key, name in _SCHEDULE_NAMES if key in t]
        if hits:
            return min(hits)[2]  # the first named, the longest name where two start together ("1F1B-I")
    return None


def interleaved(row: dict) -> bool:
    vpp_text = row["vpp"].strip().lower()
    return vpp_text.startswith("interleaved") or cell_int(vpp_text, 1) > 1 or schedule_named(row) == "interleaved"


def moe_comm_as_run(row: dict, cfg: ModelConfig, *, nvidia: bool) -> dict:
    """The expert all-to-all's `Job` fields as the row ran it. `ep_comm_overlap`: NVIDIA's MoE recipes overlap it with
    another microbatch (moe_a2a_overlap) wherever Megatron-Core allows it -- ep > 1, no full recomputation, and an
    interleaved pipeline when pp > 1 (their H100 MoE configs with a virtual pipeline set it; the one without, GPT-OSS
    pp=4, does not) -- unless the row says it was off (group AL's DeepSeek-V3 on H100). `ep_dispatcher`: "flex" where
    the row names the flex dispatcher's backend (DeepEP, HybridEP: a token sent once to each other node holding one
    of its experts), otherwise NCCL's all-to-all, Megatron-Core's default."""
    text, pp = row_text(row), cell_int(row["pp"])
    overlap = (nvidia and cfg.is_moe and cell_int(row["ep"], 1) > 1 and recompute_of(row) != "full"
               and (pp == 1 or interleaved(row)) and not re.search(r"no (ep|expert[- ]parallel) overlap", text))
    flex = re.search(r"(?<![a-z])(deepep|hybridep|flex dispatcher)(?![a-z])", text)
    return {"ep_comm_overlap": overlap, "ep_dispatcher": "flex" if flex else "alltoall"}


def issue_kind(row: dict, cfg: ModelConfig, cluster: Cluster) -> int | None:
    """Which of the three kinds of run issue 25's held-out yardstick found predicted too fast the row is, read from its
    own cells by the issue's words; None for the others:
      1. ZeRO-3 / FSDP on hundreds to thousands of GPUs (>= 128) with one or two sequences per GPU a step;
      2. a small dense model (6-10B parameters) under ZeRO-3 / FSDP on H100;
      3. a pipeline-parallel (pp >= 2) GPT-style model of 1.5-30B on A100.
    `summarize` gives the dev rows' errors per kind: the nearest the development set comes to the held-out goals."""
    n, tp, pp = cell_int(row["n_gpus"]), cell_int(row["tp"], 1), cell_int(row["pp"], 1)
    gbs, cp = cell_int(row["gbs_seqs"]), cell_int(row["cp"], 1)
    billions, sharded = model_stats.count_params(cfg)["total"] / 1e9, zero_of(row) == 3
    if sharded and n >= 128 and gbs and gbs * tp * pp * cp / n <= 2:
        return 1
    if sharded and not cfg.is_moe and 6 <= billions <= 10 and cluster.name.startswith("h100"):
        return 2
    if pp >= 2 and gpt_style(row) and 1.5 <= billions <= 30 and cluster.name.startswith("a100"):
        return 3
    return None
