"""What the conversation tests share: arithmetic chats, a `.jsonl` of them, and a model folder whose tokenizer is a
small byte-level BPE with ChatML's special tokens and template."""

import json
import random
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Arithmetic chats of one or two rounds, some with a system message, replies of different lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        msgs = [{"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a + b}." + " Sure." * (i % 3)}]
        if i % 3 == 0:
            msgs = [{"role": "system", "content": "Be brief, é."}, *msgs,
                    {"role": "user", "content": "Twice that?"}, {"role": "assistant", "content": f"{2 * (a + b)}"}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_chatml_folder(folder: Path) -> Path:
    """A model folder's tokenizer: a byte-level BPE of 300 entries with ChatML's special tokens and template,
    <|im_end|> its eos_token (as Qwen's instruct models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in conversations(50, seed=3) for m in c["messages"]]
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>",
                                                                                       "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return folder


def first_step_batch(trainer):
    """(targets, logits, the batch's cross entropy over its counted targets) of the global batch the trainer's next
    step takes, read without moving its loader."""
    import torch
    import torch.nn.functional as F

    state = trainer.loader.state_dict()
    idx = trainer.loader.next_global_indices()
    trainer.loader.load_state_dict(state)
    inputs, targets = trainer.loader.dataset.batch(idx)
    with torch.no_grad():
        logits = trainer.model(inputs).double()
    return targets, logits, float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100))
