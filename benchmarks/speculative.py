"""Speculative decoding benchmark: meshlm's engine with and without it, beside transformers' assisted generation.

    python benchmarks/speculative.py                  # CPU, a few minutes on 2 cores (most of it training)
    python benchmarks/speculative.py --batches 1,8,32 --num-speculative-tokens 4 --output-len 24

The models: a tiny Llama target (meshlm's Transformer) trained here (AdamW, until --stop-loss or --train-steps)
on RAG-style sequences -- a context of random tokens (the retrieved passage), a separator, then an answer that
quotes a span of the context -- so its answers copy from the context as retrieval-augmented answers quote their
passages; and a smaller draft trained the same way (--draft-hidden; it learns to copy later, less well). Both saved in the Hugging Face format, which meshlm and
transformers both read. The prompts: a new context, the separator and the answer's first token.

For each batch size of --batches, on the same prompts (greedy, --output-len tokens, EOS ignored):
  meshlm      `LLM` without speculation, with n-gram lookup (--num-speculative-tokens K) and with the draft, each
              timed --repeats times, interleaved, medians: output tokens/s, TPOT (per request: (last token - first
              token) / (tokens - 1), mean over requests), acceptance rate, tokens per target forward, and whether
              the tokens equal the run without speculation; and how many of the target's tokens are the quoted
              answer's (how well it learned to copy: the n-gram lookup's opportunity).
  transformers `generate` on the batch (plain), and with `prompt_lookup_num_tokens=K` and `assistant_model` (the
              draft, K tokens, constant schedule): assisted generation takes one sequence at a time, so those
              run the batch's prompts one after the other. tokens/s, time per output token of a request.
One process, one intra-op thread by default (--threads): the engine's per-step work is what speculation saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import missing_extras, parse_args_smoke, print_smoke_skip

SEP, BOS = 2, 1  # token ids of the separator and of the sequence start (the rest: 3..vocab-1, the "text")


def rag_batch(n: int, *, vocab: int, context: int, answer: int, generator: torch.Generator) -> torch.Tensor:
    """n sequences: BOS, a context of random tokens, SEP, then `answer` tokens copied from a random offset."""
    ctx = torch.randint(3, vocab, (n, context), generator=generator)
    starts = torch.randint(0, context - answer + 1, (n,), generator=generator)
    quoted = torch.stack([ctx[i, s:s + answer] for i, s in enumerate(starts.tolist())])
    return torch.cat([torch.full((n, 1), BOS), ctx, torch.full((n, 1), SEP), quoted], dim=1)


def train_copier(path: Path, args, *, hidden: int, seed: int) -> dict:
    """A Llama of `hidden` trained on `rag_batch` sequences (loss on the answer after its first token), saved
    as a Hugging Face directory at `path`. Returns what the training did."""
    from meshlm.config import ModelConfig
    from meshlm.models import build_model
    from meshlm.models.hf import save_pretrained

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=hidden, num_layers=2, num_heads=max(2, hidden // 16),
                      num_kv_heads=max(2, hidden // 16), intermediate_size=2 * hidden,
                      max_seq_len=2 * (args.context + args.answer + 2), init_std=0.02)
    model = build_model(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    first = args.context + 2  # the answer's first token: unpredictable, not in the loss
    start, losses = time.perf_counter(), []
    while len(losses) < args.train_steps and not (len(losses) >= 20 and statistics.mean(losses[-20:]) < args.stop_loss):
        x = rag_batch(args.train_batch, vocab=args.vocab, context=args.context, answer=args.answer, generator=gen)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[:, first:].reshape(-1, args.vocab),
                                                 x[:, first + 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    save_pretrained(model.eval(), path)
    return {"hidden": hidden, "layers": 2, "params": sum(p.numel() for p in model.parameters()),
            "steps": len(losses), "final_loss": round(statistics.mean(losses[-20:]), 4) if losses else None,
            "train_s": round(time.perf_counter() - start, 1)}


def prompts_of(args, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """RAG-style prompts (a context the model has never seen, SEP, the answer's first token) and the rest of the
    quoted answers, what a model that copies generates."""
    gen = torch.Generator().manual_seed(1234 + n)
    x = rag_batch(n, vocab=args.vocab, context=args.context, answer=args.answer, generator=gen)
    return x[:, :args.context + 3].tolist(), x[:, args.context + 3:].tolist()


class MeshlmRun:
    """One `LLM` (one speculative setting) timed on the same prompts as often as asked; each run stepped here to
    time every request's first and last token."""

    def __init__(self, path: Path, prompts: list[list[int]], args, speculative):
        from meshlm import LLM, SamplingParams

        llm = LLM(str(path), device="cpu", block_size=16, max_num_seqs=max(len(prompts), 1),
                  speculative=speculative, enable_prefix_caching=False)
        self.engine, self.prompts = llm.engine, prompts
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.engine.generate([prompts[0]], self.params)  # warm up (the compiled kernel, first allocations)
        self.runs: list[dict] = []

    def run(self) -> None:
        engine = self.engine
        before = {**engine.stats(), "emitted": engine.spec_stats.emitted, "forwards": engine.spec_stats.forwards}
        ids = [engine.add_request(p, self.params).request_id for p in self.prompts]
        first, last, tokens = {}, {}, {}
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                last[out.request_id], tokens[out.request_id] = now, out.token_ids
        wall = time.perf_counter() - start
        after = {**engine.stats(), "emitted": engine.spec_stats.emitted, "forwards": engine.spec_stats.forwards}
        self.tokens = [tokens[i] for i in ids]
        self.runs.append({"wall": wall, "tpot": statistics.mean((last[i] - first[i]) / max(len(tokens[i]) - 1, 1)
                                                                for i in ids),
                          **{k: after[k] - before[k] for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                               "num_steps", "generated_tokens", "emitted",
                                                               "forwards")}})

    def result(self) -> dict:
        """Medians over the runs; counts of the last one."""
        run = self.runs[-1]
        wall, proposed = statistics.median(r["wall"] for r in self.runs), run["spec_proposed_tokens"]
        return {"tokens_per_s": round(run["generated_tokens"] / wall, 1), "wall_s": round(wall, 4),
                "tpot_ms": round(1e3 * statistics.median(r["tpot"] for r in self.runs), 3),
                "runs": len(self.runs), "steps": run["num_steps"], "proposed": proposed,
                "accepted": run["spec_accepted_tokens"],
                "acceptance_rate": round(run["spec_accepted_tokens"] / proposed, 4) if proposed else None,
                "tokens_per_target_forward": round(run["emitted"] / run["forwards"], 3)}


def run_transformers(path: Path, draft: Path, prompts: list[list[int]], args) -> dict:
    """transformers' `generate`: the batch at once (plain), and one prompt at a time with prompt lookup and with
    the draft as assistant model."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(draft).eval()
    assistant.generation_config.num_assistant_tokens = args.num_speculative_tokens
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    common = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                  pad_token_id=0, eos_token_id=None)
    out = {}
    for name, extra, batched in (("plain", {}, True),
                                 ("prompt_lookup", {"prompt_lookup_num_tokens": args.num_speculative_tokens}, False),
                                 ("assistant_model", {"assistant_model": assistant}, False)):
        groups = [prompts] if batched else [[p] for p in prompts]
        with torch.no_grad():
            model.generate(torch.tensor(groups[0][:1]), **common, **extra)  # warm up
            start, tokens, latency = time.perf_counter(), [], []
            for group in groups:
                t = time.perf_counter()
                mask = torch.ones(len(group), len(group[0]), dtype=torch.long)
                gen = model.generate(torch.tensor(group), attention_mask=mask, **common, **extra)
                latency.append((time.perf_counter() - t) / args.output_len)
                tokens += gen[:, len(group[0]):].tolist()
        wall = time.perf_counter() - start
        out[name] = {"tokens_per_s": round(sum(map(len, tokens)) / wall, 1), "wall_s": round(wall, 3),
                     "time_per_output_token_ms": round(1e3 * statistics.mean(latency), 3),
                     "one_prompt_at_a_time": not batched, "_tokens": tokens}
    return out


def bench_batch(paths: dict, args, batch: int) -> dict:
    prompts, answers = prompts_of(args, batch)
    k = args.num_speculative_tokens
    settings = {"plain": None, "ngram": dict(num_speculative_tokens=k, ngram=(1, 4)),
                "draft": dict(method="draft", num_speculative_tokens=k, model=str(paths["draft"]))}
    runs = {name: MeshlmRun(paths["target"], prompts, args, spec) for name, spec in settings.items()}
    for _ in range(args.repeats):  # interleaved: a slow moment of a shared machine hits every setting
        for run in runs.values():
            run.run()
    meshlm = {name: run.result() for name, run in runs.items()}
    want = runs["plain"].tokens
    for name, run in runs.items():
        meshlm[name]["tokens_equal_meshlm_plain"] = run.tokens == want
    for name in ("ngram", "draft"):
        meshlm[name]["speedup_vs_plain"] = round(meshlm[name]["tokens_per_s"] / meshlm["plain"]["tokens_per_s"], 3)
    result = {"batch": batch, "meshlm": meshlm,
              # how well the target copies: its tokens equal to the quoted answer's (what n-gram lookup guesses)
              "answer_tokens_copied": round(sum(a == b for ws, qs in zip(want, answers) for a, b in zip(ws, qs))
                                            / sum(map(len, want)), 4)}
    if args.transformers:
        result["transformers"] = run_transformers(paths["target"], paths["draft"], prompts, args)
        for run in result["transformers"].values():
            run["tokens_equal_meshlm_plain"] = run.pop("_tokens") == want
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32", help="batch sizes (comma-separated; default 1,8,32)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="K, tokens proposed a step (default 4)")
    ap.add_argument("--output-len", type=int, default=24, help="tokens generated per prompt (default 24)")
    ap.add_argument("--context", type=int, default=64, help="context tokens of a prompt (default 64)")
    ap.add_argument("--answer", type=int, default=32, help="answer tokens a training sequence quotes (default 32)")
    ap.add_argument("--vocab", type=int, default=64, help="vocabulary (default 64)")
    ap.add_argument("--hidden", type=int, default=64, help="the target's hidden size (default 64)")
    ap.add_argument("--draft-hidden", type=int, default=32, help="the draft's hidden size (default 32)")
    ap.add_argument("--train-steps", type=int, default=1500, help="most training steps of each model (default 1500)")
    ap.add_argument("--stop-loss", type=float, default=0.1,
                    help="training stops once the mean loss of 20 steps is below this (default 0.1)")
    ap.add_argument("--train-batch", type=int, default=32, help="sequences per training step (default 32)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each meshlm setting, interleaved; the "
                                                          "median is reported (default 5)")
    ap.add_argument("--no-transformers", dest="transformers", action="store_false",
                    help="skip transformers' generate")
    args = parse_args_smoke(ap, dict(batches="1,2", output_len=6, context=16, answer=8, hidden=32, draft_hidden=16,
                                     train_steps=2, train_batch=4, repeats=1))
    missing = missing_extras("transformers", "safetensors")
    if missing:
        print_smoke_skip("speculative", {"all": f"needs {', '.join(missing)} (pip install -e \".[hf,test]\")"})
        return
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"target": Path(tmp) / "target", "draft": Path(tmp) / "draft"}
        models = {"target": train_copier(paths["target"], args, hidden=args.hidden, seed=0),
                  "draft": train_copier(paths["draft"], args, hidden=args.draft_hidden, seed=1)}
        runs = [bench_batch(paths, args, int(b)) for b in args.batches.split(",")]
    print(json.dumps({"benchmark": "speculative", "smoke": args.smoke, "threads": args.threads,
                      "num_speculative_tokens": args.num_speculative_tokens, "output_len": args.output_len,
                      "context": args.context, "models": models, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
