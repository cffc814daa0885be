"""The engine's sampling parameters beyond temperature and the filters, against references written out step by
step: logit_bias, allowed_token_ids and the penalties (batched, preempted, speculated), min_tokens,
include_stop_str_in_output, their refusals; and `LLM.chat`, the prompt through the chat template."""

import dataclasses

import pytest
import torch

from meshlm import LLM, SamplingParams
from meshlm.infer.sequence import SamplingError

transformers = pytest.importorskip("transformers")

from test_engine import MAX_NEW, _tiny_model, tiny_hf  # noqa: E402 -- after the importorskip


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama_penalties")
    tiny_hf("llama").eval().save_pretrained(path)
    return path


# Repetitive prompts: the unpenalized greedy continuation repeats tokens, so every penalty changes it.
PENALIZED_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 40, 41, 40], [9] * 6, [60, 61, 62, 63, 64, 65, 66, 67, 68]]


def _reference_with_penalties(hf, prompt, *, bias=None, repetition=1.0, frequency=0.0, presence=0.0,
                              allowed=None) -> list[int]:
    """Greedy decoding written out step by step on the transformers model: the last position's logits, only the
    allowed tokens', plus the bias; the repetition penalty over prompt and generated tokens; minus frequency x
    count and presence x seen over the generated ones; argmax."""
    tokens, generated = list(prompt), []
    for _ in range(MAX_NEW):
        with torch.no_grad():
            row = hf(torch.tensor([tokens])).logits[0, -1].double()
        if allowed is not None:
            row[[t for t in range(len(row)) if t not in allowed]] = float("-inf")
        for t, b in (bias or {}).items():
            row[t] += b
        for t in set(tokens):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t in set(generated):
            row[t] -= frequency * generated.count(t) + presence
        generated.append(int(row.argmax()))
        tokens.append(generated[-1])
    return generated


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
    dict(logit_bias={3: 30.0, 4: -100.0}),
    dict(frequency_penalty=0.7, presence_penalty=-0.5, repetition_penalty=1.3, logit_bias={33: 4.0}),
    dict(allowed_token_ids=[3, 4, 33, 60, 61], logit_bias={4: 1.0, 62: 100.0}),  # 62: not allowed, whatever its bias
], ids=["repetition", "frequency", "presence", "bias", "all", "allowed"])
def test_penalties_and_logit_bias_match_a_step_by_step_reference(llama_path, penalties):
    """Each penalty as vLLM and OpenAI define it, greedy, against the transformers model decoded one step at a
    time (and transformers' own repetition penalty); batched, preempted (the counts survive a recompute), and
    with n-gram speculation (each verified row counts the proposals before it); logprobs stay the model's."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_path).eval()
    names = {"repetition_penalty": "repetition", "frequency_penalty": "frequency", "presence_penalty": "presence",
             "logit_bias": "bias", "allowed_token_ids": "allowed"}
    want = [_reference_with_penalties(hf, p, **{names[k]: v for k, v in penalties.items()}) for p in PENALIZED_PROMPTS]
    plain = LLM(str(llama_path), device="cpu").generate(PENALIZED_PROMPTS, SamplingParams(temperature=0,
                                                                                         max_tokens=MAX_NEW))
    assert [r.token_ids for r in plain] != want  # the penalties change what greedy picks
    if list(penalties) == ["repetition_penalty"]:
        with torch.no_grad():
            for p, w in zip(PENALIZED_PROMPTS, want):
                out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.8,
                                  attention_mask=torch.ones(1, len(p), dtype=torch.long))
                got = out[0, len(p):].tolist()  # transformers stops at EOS (95); the reference ignores it
                assert got == w or (got == w[:len(got)] and got[-1] == 95), (got, w)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1, **penalties)
    for engine_kwargs in (dict(), dict(block_size=4, num_blocks=10, max_num_seqs=4),
                          dict(speculative=dict(method="ngram", num_speculative_tokens=3, ngram=(1, 3)))):
        llm = LLM(str(llama_path), device="cpu", **engine_kwargs)
        results = llm.generate(PENALIZED_PROMPTS, params)
        assert [r.token_ids for r in results] == want, engine_kwargs
        if engine_kwargs.get("num_blocks"):
            assert llm.engine.stats()["num_preemptions"] > 0
        if "speculative" in engine_kwargs:
            stats = llm.engine.stats()
            assert stats["spec_proposed_tokens"] > 0 or list(penalties) == ["repetition_penalty"]
            if len(penalties) > 1:  # proposals accepted: the rows after them count them as generated
                assert stats["spec_accepted_tokens"] > 0
    p, r = PENALIZED_PROMPTS[0], results[0]
    with torch.no_grad():
        model = torch.log_softmax(hf(torch.tensor([p + r.token_ids])).logits[0].double(), -1)
    for i, entry in enumerate(r.logprobs):  # the model's own distribution, not the penalized one
        assert abs(entry["logprob"] - float(model[len(p) - 1 + i, r.token_ids[i]])) < 1e-4


def test_each_verified_row_is_penalized_for_the_proposals_before_it():
    """Speculative decoding's row j follows the generated tokens and the first j proposals: its penalties count
    them (written out by hand: logits of 1, repetition 2 over prompt [1, 2] and what follows, frequency 1,
    presence 0.5, generated [3], proposals [3, 4])."""
    from meshlm.infer.sampling import penalize
    from meshlm.infer.sequence import Sequence

    seq = Sequence([1, 2], SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0))
    seq.output_token_ids = [3]
    got = penalize(torch.ones(3, 6), seq, [3, 4])
    want = torch.tensor([[1, .5, .5, .5 - 1.5, 1, 1],  # 3 generated once
                         [1, .5, .5, .5 - 2.5, 1, 1],  # 3 twice (the first proposal)
                         [1, .5, .5, .5 - 2.5, .5 - 1.5, 1]])  # and 4 once
    assert torch.equal(got, want), got


def test_penalties_are_refused_out_of_range():
    for kw, says in ((dict(presence_penalty=2.5), "presence_penalty=2.5 must be in"),
                     (dict(frequency_penalty=float("nan")), "frequency_penalty=nan must be a finite number"),
                     (dict(repetition_penalty=0), "repetition_penalty=0.0 must be > 0"),
                     (dict(logit_bias={1: 200}), "must map token ids to biases in"),
                     (dict(logit_bias={-1: 1}), "must map token ids"), (dict(logit_bias=[1]), "must map token ids")):
        with pytest.raises(SamplingError, match=says):
            SamplingParams(**kw)
    with pytest.raises(SamplingError, match=r"logit_bias \[500\] are outside the vocabulary"):
        LLM(_tiny_model(), device="cpu").generate([[1, 2]], SamplingParams(logit_bias={500: 1.0}))
    # allowed tokens that min_tokens all holds back: the request's own error, greedy or drawn (a review: greedy
    # picked token 0, which it did not allow, and a draw failed on NaN probabilities)
    for temperature in (0, 1.0):
        out = LLM(_tiny_model(), device="cpu").generate([[1, 2]], SamplingParams(
            allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2, temperature=temperature))[0]
        assert out.finish_reason == "error" and out.error_field == "allowed_token_ids" and out.token_ids == [], out
        assert "allowed_token_ids allows only tokens min_tokens holds back" in out.error


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(llama_path):
    """vLLM's min_tokens: the model's EOS (95) and a stop token id, made the likeliest tokens by a bias, are not
    sampled before min_tokens tokens; after, the EOS ends the request at once."""
    llm = LLM(str(llama_path), device="cpu")
    eos = llm.engine.eos_token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 50.0, eos - 1: 49.0},
                            stop_token_ids=[eos - 1])
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == [eos]
    out = llm.generate([[5, 6, 7]], dataclasses.replace(params, min_tokens=6))[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and not {eos, eos - 1} & set(out.token_ids[:6])
    assert out.finish_reason == "stop"
    with pytest.raises(SamplingError, match=r"min_tokens=30 must be an integer in \[0, max_tokens=20\]"):
        dataclasses.replace(params, min_tokens=30)
    # no token is speculated before min_tokens: a step crossing it could find a stop string that one token a step
    # would not look for (found by a review)
    spec = LLM(str(llama_path), device="cpu", speculative=dict(method="ngram", num_speculative_tokens=3, ngram=(1, 2)))
    repeat = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec.generate([[5, 6, 7, 5, 6, 7, 5, 6]], dataclasses.replace(repeat, min_tokens=12))
    assert spec.engine.stats()["spec_proposed_tokens"] == 0
    spec.generate([[5, 6, 7, 5, 6, 7, 5, 6]], repeat)
    assert spec.engine.stats()["spec_proposed_tokens"] > 0


def test_a_stop_string_is_kept_in_the_text_with_include_stop_str_in_output(tmp_path):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it, whole and streamed."""
    from tiny_hf import make_model_dir

    llm = LLM(str(make_model_dir(tmp_path)), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate(["hello world"], params)[0].text
    stop = text[3:5]
    cut = llm.generate(["hello world"], dataclasses.replace(params, stop=[stop]))[0]
    kept = llm.generate(["hello world"], dataclasses.replace(params, stop=[stop], include_stop_str_in_output=True))[0]
    assert cut.text == text[:text.index(stop)] and kept.text == cut.text + stop, (text, stop)
    assert kept.finish_reason == cut.finish_reason == "stop"
    seq = llm.engine.add_request("hello world", dataclasses.replace(params, stop=[stop],
                                                                     include_stop_str_in_output=True))
    pieces = []
    while llm.engine.has_unfinished():
        pieces += [o.new_text for o in llm.engine.step() if o.request_id == seq.request_id]
    assert "".join(pieces) == kept.text


def test_llm_chat_is_generate_of_the_chat_templates_prompt(tmp_path):
    """LLM.chat (vLLM's): a conversation, or several, through the chat template with the server's options; the
    same tokens as generate() of the template's prompt."""
    from tiny_hf import make_model_dir

    llm = LLM(str(make_model_dir(tmp_path)), device="cpu")
    tok, params = llm.tokenizer, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ask = [{"role": "user", "content": "hello world"}]
    prefilled = [*ask, {"role": "assistant", "content": "hello"}]
    got = llm.chat(ask, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in llm.generate([tok.encode_chat(ask)], params)]
    both = llm.chat([ask, ask[:1] + [{"role": "assistant", "content": "hi"}, *ask]], params)
    assert len(both) == 2 and both[0].token_ids == got[0].token_ids
    cont = llm.chat(prefilled, params, add_generation_prompt=False, continue_final_message=True)
    prompt = tok.encode_chat(prefilled, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(prompt).endswith("<|assistant|>\nhello")
    assert cont[0].token_ids == llm.generate([prompt], params)[0].token_ids
    # as the server builds a chat's prompt: text parts joined, an assistant's null content with its calls, an
    # earlier reply's reasoning (a review: LLM.chat rendered the parts' list and "None")
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    assert llm.chat(parts, params)[0].token_ids == got[0].token_ids
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    null = llm.chat([*ask, {"role": "assistant", "content": None, "tool_calls": calls}, *ask], params)
    empty = llm.chat([*ask, {"role": "assistant", "content": ""}, *ask], params)
    assert null[0].token_ids == empty[0].token_ids
    for kwargs, says in ((dict(continue_final_message=True), "give add_generation_prompt false with it"),
                         (dict(add_generation_prompt=False, continue_final_message=True), "role is 'user'")):
        with pytest.raises(ValueError, match=says):
            llm.chat(ask, params, **kwargs)
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([[]], params)
    with pytest.raises(ValueError, match="give a conversation"):  # it answered [] (a review)
        llm.chat([], params)
    with pytest.raises(ValueError, match="chat_template_kwargs sets messages, which the server sets"):
        llm.chat(ask, params, chat_template_kwargs={"messages": []})
