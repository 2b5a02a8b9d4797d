"""Structured outputs on the tiny random Llama: every completion matches its constraint, greedy tokens equal a
transformers loop masked by llguidance itself, bad constraints are refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvgen.engine import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from kvgen.engine.structured_outputs import JSON_WHITESPACE
from kvgen.loader import load_model

from helpers import top_of

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "string", "maxLength": 5}}}


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def llm(model_tok):
    model, tok = model_tok
    return LLM(model, tok, num_blocks=256)


def _texts(llm, constraint: StructuredOutputsParams, **params) -> list[tuple[str, str]]:
    sampling = SamplingParams(structured_outputs=constraint, **{"max_tokens": 200, **params})
    (out,) = llm.generate(["Name three colours:"], sampling, use_tqdm=False)
    return [(c.text, c.finish_reason) for c in out.outputs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_completions_match_their_constraint(llm, seed):
    sample = {"temperature": 1.0, "seed": seed, "n": 3}
    for text, reason in _texts(llm, StructuredOutputsParams(regex=r"[0-9]{3}-(ab|cd)"), **sample):
        assert reason == "stop" and re.fullmatch(r"[0-9]{3}-(ab|cd)", text), text  # the final "b"/"d" is kept
    for text, reason in _texts(llm, StructuredOutputsParams(choice=["red", "green", "blue"]), **sample):
        assert reason == "stop" and text in ("red", "green", "blue")
    for text, reason in _texts(llm, StructuredOutputsParams(json=SCHEMA), **sample):
        value = json.loads(text)
        assert reason == "stop" and set(value) == {"a", "b"}, text
        assert isinstance(value["a"], int) and 0 <= value["a"] <= 99 and isinstance(value["b"], str) and len(value["b"]) <= 5
    for text, reason in _texts(llm, StructuredOutputsParams(json_object=True), **sample | {"n": 1}):
        assert reason in ("stop", "length")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_a_choice_of_thousands_of_strings(llm):
    """2500 choices with quotes, backslashes, newlines and non-ASCII: each completion is one of them (llguidance's
    "choice" grammar, one parser item per string, failed at the first token from 2000 strings on)."""
    words = [f'{i}"\\\né😀' for i in range(2500)]
    for text, reason in _texts(llm, StructuredOutputsParams(choice=words), temperature=1.0, seed=5, n=3):
        assert reason == "stop" and text in words, (text, reason)


def test_an_output_its_last_allowed_token_completes_is_a_stop(llm, model_tok):
    """A choice completed by exactly the max_tokens-th token is whole: "stop", not "length" (a client reads "length"
    as truncated); one token short of it is "length"."""
    _, tok = model_tok
    word = "green"
    num_tokens = len(tok.encode(word, add_special_tokens=False))
    choice = StructuredOutputsParams(choice=[word])
    assert _texts(llm, choice, temperature=0.0, max_tokens=num_tokens) == [(word, "stop")]
    if num_tokens > 1:
        text, reason = _texts(llm, choice, temperature=0.0, max_tokens=num_tokens - 1)[0]
        assert reason == "length" and word.startswith(text) and text != word


def test_a_lark_grammar_and_a_gbnf_grammar(llm):
    lark = 'start: "say " WORD "!"\nWORD: /[a-z]{2,4}/'
    gbnf = 'root ::= "x=" [0-9] [0-9]? ";"'
    for text, reason in _texts(llm, StructuredOutputsParams(grammar=lark), temperature=1.0, seed=3, n=3):
        assert reason == "stop" and re.fullmatch(r"say [a-z]{2,4}!", text), text
    for text, reason in _texts(llm, StructuredOutputsParams(grammar=gbnf), temperature=1.0, seed=4, n=3):
        assert reason == "stop" and re.fullmatch(r"x=[0-9]{1,2};", text), text


def test_greedy_tokens_equal_a_transformers_loop_masked_by_llguidance(llm, model_tok, tiny_model_dir):
    """The reference: transformers' model on the same directory, each step's argmax over the tokens llguidance's own
    matcher allows (its bitmask, not ours), fed back to that matcher."""
    import llguidance
    import transformers

    _, tok = model_tok
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ll_tok = llguidance.LLTokenizer(tok.backend_json(), n_vocab=hf.config.vocab_size, eos_token=tok.eos_token_ids)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_pattern": JSON_WHITESPACE})
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    prompt = tok.encode("Name three colours:")
    ids = list(prompt)
    with torch.inference_mode():
        while not matcher.is_stopped() and len(ids) < len(prompt) + 200:
            logits = hf(torch.tensor([ids])).logits[:, -1].float()  # [1, V]
            bitmask = matcher.compute_bitmask()  # one bit per token, little-endian
            allowed = [t for t in range(logits.shape[1]) if bitmask[t // 8] >> (t % 8) & 1]
            ids.append(max(allowed, key=lambda t: float(logits[0, t])))
            assert matcher.consume_token(ids[-1])
    expected = ids[len(prompt):]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200,
                                                   structured_outputs=StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)
    assert out.outputs[0].token_ids == expected and out.outputs[0].finish_reason == "stop"
    json.loads(out.outputs[0].text)


def test_logprobs_are_over_the_grammars_tokens_and_other_requests_are_untouched(llm):
    """vLLM v1 masks the logits in place (``apply_grammar_bitmask``) before its sampler takes the raw logprobs, so a
    constrained request's logprobs are a log-softmax over the tokens its grammar allows: here digits only, the chosen
    one among them (they listed the unconstrained top tokens, words, before). An unconstrained request in the same
    batch gets the tokens and logprobs it gets alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    alone = llm.generate(["Name three colours:"], greedy, use_tqdm=False)[0].outputs[0]
    constrained = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3,
                                 structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    both = llm.generate(["Name three colours:"] * 2, [greedy, constrained], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.token_ids
    digits = both[1].outputs[0]
    assert re.fullmatch("[0-9]+", digits.text)
    for batched, single in zip(both[0].outputs[0].logprobs, alone.logprobs, strict=True):  # batched matmuls: ~1e-6
        assert batched.keys() == single.keys()
        assert all(abs(batched[t].logprob - single[t].logprob) < 1e-4 for t in single)
    tok = llm.get_tokenizer()
    for position, chosen in zip(digits.logprobs, digits.token_ids):
        assert position[chosen].rank == 1  # greedy over the allowed tokens: the top of what is reported
        assert all(re.fullmatch("[0-9]+", tok.decode([t])) for t in top_of(position, 3)
                   if position[t].logprob > float("-inf")), [tok.decode([t]) for t in position]
    assert set(top_of(digits.logprobs[0], 3)).isdisjoint(top_of(alone.logprobs[0], 3))


def test_a_matcher_that_fails_while_masking_ends_the_request_with_its_error(llm):
    """llguidance can fail while computing a mask (here at a required property whose schema is a $ref cycle); its
    mask then allows EOS alone, which ended the half-written object as a complete "stop". It is now an abort with the
    matcher's error, as a failure on a drawn token is."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/c"}}, "required": ["a"],
              "$defs": {"c": {"$ref": "#/$defs/c"}}}
    constraint = StructuredOutputsParams(json=schema)
    (out,) = llm.generate(["Name three colours:"], SamplingParams(temperature=1.0, seed=0, max_tokens=60,
                                                                  structured_outputs=constraint), use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort", out.outputs[0].text
    assert out.error.startswith("structured_outputs: the grammar failed at output token"), out.error


def test_n_completions_keep_the_error_of_one_that_failed(llm):
    """n > 1 under ``LLM.generate`` (FINAL_ONLY): completions that fail in their grammar (the $ref cycle's branch of
    an anyOf) while others go on to the end leave the request's error in its final output; it was only in the merged
    output of the step the failure happened in, which FINAL_ONLY drops: "abort" completions with error None."""
    schema = {"anyOf": [{"type": "object", "properties": {"a": {"$ref": "#/$defs/c"}}, "required": ["a"]},
                        {"type": "string"}, {"type": "array"}], "$defs": {"c": {"$ref": "#/$defs/c"}}}
    constraint = StructuredOutputsParams(json=schema)
    (out,) = llm.generate(["Name three colours:"], SamplingParams(temperature=1.0, seed=0, n=8, max_tokens=30,
                                                                  structured_outputs=constraint), use_tqdm=False)
    failed = [c for c in out.outputs if c.finish_reason == "abort"]
    finished = [c for c in out.outputs if c.finish_reason != "abort"]
    assert failed and finished and max(len(c.token_ids) for c in finished) > min(len(c.token_ids) for c in failed)
    assert out.error is not None and out.error.startswith("structured_outputs: the grammar failed at output token")
    assert out.error_param == "structured_outputs"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"json_object": False}, "exactly one of"),
])
def test_bad_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex="(ab"), StructuredOutputsParams(json="{not json"),
    StructuredOutputsParams(json={"type": "nonsense"}), StructuredOutputsParams(grammar="start: undefined_rule"),
    # $ref cycles, whose matcher fails at its first mask: they ended at once with "stop" and an empty text
    StructuredOutputsParams(json={"$ref": "#"}),
    StructuredOutputsParams(json={"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}}),
])
def test_constraints_that_do_not_compile_are_refused_at_add_request(model_tok, constraint):
    model, tok = model_tok
    engine = LLMEngine(model, tok)
    with pytest.raises(ValueError, match="structured_outputs"):
        engine.add_request("a", "hi", SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests()
    engine.add_request("a", "hi", SamplingParams(max_tokens=2))  # the id was not taken by the refused request
    with pytest.raises(ValueError, match="needs a tokenizer"):
        LLMEngine(model, None).add_request("b", [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


@pytest.mark.parametrize("text", ["true", "3", "[1]", '"x"'])
def test_json_text_that_is_no_object_is_refused_by_name(model_tok, text):
    """JSON text that parses to no schema object (a string went to llguidance as JSON text again: "expected value at
    line 1 column 1")."""
    model, tok = model_tok
    assert not isinstance(json.loads(text), dict)
    with pytest.raises(ValueError, match=f"the json schema must be a JSON object, got {re.escape(repr(text))}"):
        LLMEngine(model, tok).add_request("a", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(json=text)))


def test_a_schema_dict_that_holds_itself_is_refused_by_name(model_tok):
    """A Python dict that contains itself is no JSON (json.dumps: "Circular reference detected"); llguidance's
    conversion of it overflowed the stack and the process died of a segfault."""
    model, tok = model_tok
    schema: dict = {"type": "object", "properties": {}}
    schema["properties"]["a"] = schema
    with pytest.raises(ValueError, match="Circular reference"):
        json.dumps(schema)
    engine = LLMEngine(model, tok)
    with pytest.raises(ValueError, match="the json schema is not JSON data: Circular reference detected"):
        engine.add_request("a", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    assert not engine.has_unfinished_requests()


def test_a_regex_ending_in_a_lone_backslash_is_refused(model_tok):
    """A trailing lone backslash is an incomplete escape (Python's re refuses it, as Rust's regex does); llguidance
    dropped it, so "a\\" constrained the output to "a" and "\\" to the empty text."""
    model, tok = model_tok
    engine = LLMEngine(model, tok)
    for regex in ("a\\", "\\", "a\\\\\\"):
        with pytest.raises(re.error):
            re.compile(regex)
        with pytest.raises(ValueError, match="ends in an incomplete escape"):
            engine.add_request("a", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex)))
    escaped = "a\\\\"  # an escaped backslash is one backslash
    (out,) = LLM(model, tok, num_blocks=16).generate(["hi"], SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=escaped)), use_tqdm=False)
    assert re.fullmatch(escaped, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(("schema", "pattern"), [
    ({"type": "string", "pattern": "\\"}, "\\"),
    ({"type": "string", "pattern": "^a\\\\\\"}, "^a\\\\\\"),
    ({"type": "object", "properties": {"k": {"type": "string", "pattern": "b\\"}}, "required": ["k"]}, "b\\"),
    ({"type": "object", "patternProperties": {"x\\": {"type": "integer"}}, "additionalProperties": False}, "x\\"),
    ({"$defs": {"d": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "c\\"}]}}, "$ref": "#/$defs/d"}, "c\\"),
    ({"type": "array", "items": {"type": "string", "pattern": "d\\"}}, "d\\"),
])
def test_a_schema_pattern_ending_in_a_lone_backslash_is_refused(model_tok, schema, pattern):
    """A schema's pattern (or patternProperties name) ending in a lone backslash, which Python's re refuses as it
    does the regex field's: llguidance dropped the backslash, so {"pattern": "\\"} left the string unconstrained
    and "^a\\" matched any string starting with "a"."""
    model, tok = model_tok
    with pytest.raises(re.error):
        re.compile(pattern)
    engine = LLMEngine(model, tok)
    with pytest.raises(ValueError, match=f"the json schema's pattern {re.escape(repr(pattern))} ends in an incomplete"):
        engine.add_request("a", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    escaped = {"type": "string", "pattern": "^a\\\\$", "enum": ["a\\"]}  # an escaped backslash; a value is no pattern
    (out,) = LLM(model, tok, num_blocks=16).generate(["hi"], SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=escaped)), use_tqdm=False)
    assert re.fullmatch(escaped["pattern"], json.loads(out.outputs[0].text)) and out.outputs[0].finish_reason == "stop"


def test_the_default_model_answers_in_its_schema(ours_default_auto):
    """The real model through its chat template: greedy JSON that parses, has the required keys and ends with
    "stop" (without the constraint it writes prose)."""
    model, tok = ours_default_auto
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Ann is 31. Describe her."}],
                                     add_generation_prompt=True, tokenize=True)
    llm = LLM(model, tok, num_blocks=64)
    constrained, free = llm.generate([prompt] * 2, [
        SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=64)], use_tqdm=False)
    assert constrained.outputs[0].finish_reason == "stop"
    value = json.loads(constrained.outputs[0].text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.outputs[0].text)
