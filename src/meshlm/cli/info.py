"""`meshlm info`: parameter counts, FLOPs per token and weight memory of a model."""

from __future__ import annotations




def add_parser(sub) -> None:
    p = sub.add_parser("info", help="parameter counts, FLOPs per token and weight memory of a model",
                       description="Describe a model: parameters (total, embedding, active per token for MoE), "
                                   "training FLOPs per token, and the memory its weights take.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="tiny", metavar="PRESET", help="a preset name (default tiny)")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory or config.json")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length for the attention FLOPs, up to the model's "
                                                           "context (default 0: 4096, or the context if shorter)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    import json

    from meshlm.config import ModelConfig
    from meshlm.models.stats import count_params, flops_per_token
    from meshlm.planner.mla import total_params

    cfg = ModelConfig.from_hf(args.hf) if args.hf else ModelConfig.from_preset(args.model)
    if not 0 <= args.seq_len <= cfg.max_seq_len:
        raise ValueError(f"--seq-len={args.seq_len} must be in 1..{cfg.max_seq_len} (the model's context), or 0 "
                         "for the default")
    seq_len = args.seq_len or min(4096, cfg.max_seq_len)
    params = count_params(cfg)
    flops = flops_per_token(cfg, seq_len)
    info = {"model": args.hf or args.model, "seq_len": seq_len, "params": params,
            "train_flops_per_token": 3 * flops, "forward_flops_per_token": flops,
            "weights_gib": {"fp32": params["total"] * 4 / 2**30, "bf16": params["total"] * 2 / 2**30}}
    latent = total_params(cfg, "megatron")  # the deepseek-v3 preset: its latent attention, as `meshlm plan` prices it
    if latent != params["total"]:
        info["params_with_latent_attention"] = latent
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model            {info['model']}  ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, vocab {cfg.vocab_size}"
          + (f", {cfg.num_experts} experts top-{cfg.num_experts_per_token}" if cfg.is_moe else "") + ")")
    for key, value in params.items():
        print(f"params.{key:<11} {value:>20,}  ({value / 1e9:.3f} B)")
    if "params_with_latent_attention" in info:
        print(f"params.{'latent':<11} {latent:>20,}  ({latent / 1e9:.3f} B) with its latent attention, as "
              "`meshlm plan` prices it (meshlm's model: GQA of its width)")
    print(f"FLOPs/token      {3 * flops:>20.4g}  training (fwd+bwd) at seq_len {seq_len}; forward {flops:.4g}")
    print(f"weights          {info['weights_gib']['bf16']:>20.2f}  GiB in bf16 "
          f"({info['weights_gib']['fp32']:.2f} GiB fp32)")
    return 0
