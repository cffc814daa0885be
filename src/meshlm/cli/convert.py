"""`meshlm convert`: a meshlm checkpoint to a Hugging Face directory and back."""

from __future__ import annotations

import argparse
import sys



def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a meshlm checkpoint to a Hugging Face folder, or the other way",
        description="Convert between meshlm training checkpoints and Hugging Face model directories.\n\n"
                    "--to-hf OUT_DIR: INPUT is a meshlm run directory (its checkpoints/latest), its checkpoints/\n"
                    "  folder or one step_N checkpoint, trained under any layout. OUT_DIR gets config.json (llama,\n"
                    "  qwen2 or qwen3 when dense; mixtral, qwen2_moe or qwen3_moe for MoE: whichever expresses the\n"
                    "  model config exactly), model.safetensors and the run's tokenizer.json if it had one; it\n"
                    "  loads with transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR). A model no Hugging\n"
                    "  Face type expresses is refused, naming the model field.\n"
                    "--to-meshlm RUN_DIR: INPUT is a Hugging Face directory (config.json + safetensors; llama,\n"
                    "  mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe). RUN_DIR gets a complete checkpoint\n"
                    "  at step 0 (the weights, a fresh optimizer state, its tokenizer.json) and config.toml (the\n"
                    "  run's config); fine-tune with `meshlm train --config RUN_DIR/config.toml --resume`, or\n"
                    "  generate from it at once. The data, train.seed and train.global_batch_size are fixed here\n"
                    "  (--set): the checkpoint's data loader position refers to them.\n\n"
                    "An output directory that is not empty is refused unless --overwrite.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  meshlm convert runs/default --to-hf hf/tiny                # latest checkpoint of a run\n"
               "  meshlm convert runs/x/checkpoints/step_000100 --to-hf hf/x --dtype bfloat16\n"
               "  python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf/tiny')\"\n"
               "  meshlm convert ~/models/Qwen3-0.6B --to-meshlm runs/qwen3-ft \\\n"
               "      --set data.path=my_corpus/ --set train.steps=200 --set train.lr=1e-5\n"
               "  meshlm train --config runs/qwen3-ft/config.toml --resume      # fine-tune from those weights\n"
               "  meshlm generate --checkpoint runs/qwen3-ft --prompt \"Hello\"")
    p.add_argument("input", metavar="CHECKPOINT_OR_RUN_DIR|HF_DIR",
                   help="a meshlm run dir or checkpoint (with --to-hf), or a Hugging Face directory (with --to-meshlm)")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-hf", metavar="OUT_DIR", help="write a Hugging Face model directory")
    to.add_argument("--to-meshlm", metavar="RUN_DIR", help="write a meshlm run directory (checkpoint at step 0)")
    p.add_argument("--overwrite", action="store_true", help="replace what the output directory holds")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="--to-hf: dtype of the written weights (default: the checkpoint's, fp32 master weights)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="--to-meshlm: a train/data/parallel field of the new run, e.g. data.path=corpus/ "
                        "(repeatable; the model comes from the Hugging Face config)")


def run(args) -> int:
    from meshlm import convert

    if args.to_hf is not None:
        if args.overrides:
            raise ValueError("--set applies to --to-meshlm only (the checkpoint's config is what is exported)")
        info = convert.to_hf(args.input, args.to_hf, overwrite=args.overwrite, dtype=args.dtype)
        for note in info["notes"]:
            print(f"meshlm convert: note: {note}", file=sys.stderr)
        tokenizer = {"tokenizer.json": "its tokenizer.json", "bytes": "a tokenizer.json of its byte tokenizer",
                     None: "no tokenizer"}[info["tokenizer"]]
        print(f"wrote {info['to']}: {info['architecture']} ({info['model_type']}, {info['dtype']}) from "
              f"{info['from']} (step {info['step']}), with {tokenizer}")
        return 0
    if args.dtype is not None:
        raise ValueError("--dtype applies to --to-hf only (a meshlm checkpoint keeps fp32 master weights)")
    info = convert.to_meshlm(args.input, args.to_meshlm, overwrite=args.overwrite, overrides=args.overrides)
    print(f"wrote {info['checkpoint']} ({info['model_type']} from {info['from']}, step 0, tokenizer: "
          f"{info['tokenizer']})\nfine-tune: meshlm train --config {info['config']} --resume")
    return 0
