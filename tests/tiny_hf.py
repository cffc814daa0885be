"""A tiny random Hugging Face Llama directory with its own byte-level BPE tokenizer.json, for the serving tests
(and the GPU checks, where the HTTP stack may be absent)."""

import transformers

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is meshlm serving tokens",
          "def add(a, b):\n    return a + b", "continuous batching with a paged kv cache"] * 20


def make_model_dir(path, *, max_len: int = 128):
    """A tiny random Llama with a small byte-level BPE tokenizer.json (no chat template)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max_len, eos_token_id=tok.token_to_id("</s>"),
                                   bos_token_id=tok.token_to_id("<s>"), initializer_range=0.2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path
