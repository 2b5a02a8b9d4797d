"""generate(): cache equivalences, padded batches, seeded sampling, errors."""

from __future__ import annotations

import pytest
import torch
from helpers import left_pad

from kvgen.errors import ContextLengthError
from kvgen.generation import GenerationConfig, generate

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "In 1969, the first humans landed on the Moon. The mission was called",
]


@pytest.fixture(scope="module")
def model_tok(ours_default):
    return ours_default


def test_no_cache_dynamic_and_static_cache_give_identical_tokens(model_tok):
    model, tok = model_tok
    ids = torch.tensor([tok.encode(PROMPTS[2])])
    outs = {
        name: generate(model, ids, None, GenerationConfig(max_new_tokens=24, **kw)).new_token_ids[0]
        for name, kw in {
            "none": {"use_cache": False},
            "dynamic": {"cache_implementation": "dynamic"},
            "static": {"cache_implementation": "static"},
        }.items()
    }
    assert len(outs["static"]) > 1
    assert outs["none"] == outs["dynamic"] == outs["static"]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_batch_equals_each_prompt_alone(model_tok, cache):
    model, tok = model_tok
    rows = [tok.encode(p) for p in PROMPTS]
    ids, mask = left_pad(rows, tok.pad_token_id)
    cfg = GenerationConfig(max_new_tokens=16, cache_implementation=cache)
    batched = generate(model, ids, mask, cfg)
    for i, row in enumerate(rows):
        alone = generate(model, torch.tensor([row]), None, cfg)
        assert batched.new_token_ids[i] == alone.new_token_ids[0]
        assert batched.finish_reasons[i] == alone.finish_reasons[0]


def test_seeded_sampling_is_reproduced_exactly_and_seed_matters(model_tok):
    model, tok = model_tok
    ids = torch.tensor([tok.encode(PROMPTS[1])] * 2)
    cfg = GenerationConfig(max_new_tokens=20, do_sample=True, temperature=1.3, top_k=0, seed=7)
    a = generate(model, ids, None, cfg)
    b = generate(model, ids, None, cfg)
    c = generate(model, ids, None, cfg.replace(seed=8))
    assert a.sequences.tolist() == b.sequences.tolist()
    assert a.sequences.tolist() != c.sequences.tolist()
    g = torch.Generator().manual_seed(7)
    d = generate(model, ids, None, cfg.replace(seed=None), generator=g)
    assert d.sequences.tolist() == a.sequences.tolist()


def test_eos_stops_row_and_pads_rest(model_tok):
    model, tok = model_tok
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=True)
    rows = [chat, tok.encode(PROMPTS[0])]
    ids, mask = left_pad(rows, tok.pad_token_id)
    out = generate(model, ids, mask, GenerationConfig(max_new_tokens=60, cache_implementation="static"))
    assert out.finish_reasons[0] == "stop"
    first = out.new_token_ids[0]
    assert first[-1] in tok.eos_token_ids and not any(t in tok.eos_token_ids for t in first[:-1])
    tail = out.sequences[0, out.prompt_length + len(first):].tolist()
    assert tail == [tok.pad_token_id] * len(tail)


def test_num_return_sequences_with_sampling(model_tok):
    model, tok = model_tok
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    out = generate(model, ids, None, GenerationConfig(max_new_tokens=8, do_sample=True, num_return_sequences=3, seed=0))
    assert out.sequences.shape[0] == 3 and len(out.finish_reasons) == 3


def test_prompt_that_leaves_no_room_raises(model_tok):
    model, _ = model_tok
    n = model.config.max_position_embeddings
    ids = torch.ones((1, n), dtype=torch.long)
    with pytest.raises(ContextLengthError, match=f"exceeds the context window of {n} tokens"):
        generate(model, ids, None, GenerationConfig(max_new_tokens=1))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_new_tokens": 0}, r"max_new_tokens must be an int in \[1, 2147483647\], got 0"),
        ({"do_sample": True, "temperature": 0.0}, "temperature=0.0 conflicts with do_sample=True"),
        ({"temperature": -1.0}, r"temperature must be a finite number >= 0 \(0 = greedy\), got -1.0"),
        ({"repetition_penalty": 5e-324}, r"repetition_penalty must be in \[1e-06, 1000000\], got 5e-324"),
        ({"top_k": 2**70}, r"top_k must be an int in \[0, 2147483647\] \(0 = off\), got 1180591620717411303424"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, r"top_k must be an int in \[0, 2147483647\] \(0 = off\), got -1"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[1e-06, 1000000\], got 0.0"),
        ({"cache_implementation": "paged"}, "cache_implementation must be 'dynamic' or 'static', got 'paged'"),
        ({"num_return_sequences": 2}, "num_return_sequences=2 conflicts with do_sample=False"),
        ({"num_beams": 4, "num_beam_groups": 3}, "num_beam_groups=3 conflicts with num_beams=4"),
        ({"num_beams": 4, "num_beam_groups": 2}, "num_beam_groups=2 conflicts with diversity_penalty=0.0"),
        ({"num_beams": 2, "diversity_penalty": 1.0}, "diversity_penalty=1.0 conflicts with num_beam_groups=1"),
        ({"penalty_alpha": 0.6, "do_sample": True}, "penalty_alpha=0.6 conflicts with do_sample=True"),
    ],
)
def test_invalid_generation_config_raises_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)


def test_bad_batches_raise(model_tok):
    model, _ = model_tok
    with pytest.raises(ValueError, match="2-D tensor"):
        generate(model, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="attention_mask must be a tensor .* got GenerationConfig .*generation_config="):
        generate(model, torch.tensor([[1, 2, 3]]), GenerationConfig(max_new_tokens=2))  # HF's positional order
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 49152\)"):
        generate(model, torch.tensor([[1, 2, 10**6]]))


# ---------------------------------------------------------------- no attention_mask: inferred as transformers does

@pytest.fixture(scope="module")
def tiny():
    from helpers import make_tiny_model

    return make_tiny_model("llama", eos_token_id=2)


@pytest.mark.parametrize("pad", [0, 2])  # 0: inferred from the pad tokens; 2 (= EOS): cannot be, all ones
def test_no_attention_mask_is_inferred_from_pad_token_id_as_transformers(tiny, pad):
    ids = torch.tensor([[0, 0, 5, 17, 42], [8, 61, 3, 29, 11]])
    with torch.inference_mode():
        want = tiny.ref.generate(ids, pad_token_id=pad, max_new_tokens=5, do_sample=False)
    out = generate(tiny.ours, ids, None, max_new_tokens=5, pad_token_id=pad)
    assert out.sequences.tolist() == want.tolist()
    masked = generate(tiny.ours, ids, (ids != 0).long(), max_new_tokens=5, pad_token_id=pad)
    assert (out.sequences.tolist() == masked.sequences.tolist()) == (pad == 0)  # pad 2: the zeros are tokens


def test_pad_tokens_after_a_token_stay_tokens_and_a_row_of_pads_is_refused(tiny):
    """Only each row's leading pads are inferred as padding: a pad id after a token (a chat template's <|im_end|> when
    it is the pad id) stays a token, as with an all-ones mask; a row of pads only has nothing to continue."""
    ids = torch.tensor([[0, 5, 0, 17], [4, 5, 0, 17]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    out = generate(tiny.ours, ids, None, max_new_tokens=3, pad_token_id=0)
    assert out.sequences.tolist() == generate(tiny.ours, ids, mask, max_new_tokens=3, pad_token_id=0).sequences.tolist()
    with pytest.raises(ValueError, match=r"a row of input_ids holds only pad_token_id=0"):
        generate(tiny.ours, torch.tensor([[0, 0], [5, 6]]), None, max_new_tokens=2, pad_token_id=0)


def test_a_streamer_generator_or_tokenizer_of_another_kind_is_refused_before_any_step(tiny):
    """transformers fails with an AttributeError at the first put (a streamer without end: after the whole
    generation); kvgen names the argument before a forward runs."""
    puts = []

    class NoEnd:
        def put(self, value):
            puts.append(value)

    ids = torch.tensor([[5, 17, 42]])
    with pytest.raises(TypeError, match="streamer must have put.* and end.*got object"):
        generate(tiny.ours, ids, max_new_tokens=2, streamer=object())
    with pytest.raises(TypeError, match="streamer must have put.* and end.*got NoEnd"):
        generate(tiny.ours, ids, max_new_tokens=2, streamer=NoEnd())
    assert puts == []
    for bad in ("x", [5]):
        with pytest.raises(TypeError, match="generator must be a torch.Generator"):
            generate(tiny.ours, ids, max_new_tokens=2, do_sample=True, generator=bad)
    with pytest.raises(TypeError, match="tokenizer must have a decode.*got int"):
        generate(tiny.ours, ids, max_new_tokens=2, stop_strings=["a"], tokenizer=5)
    seeded = generate(tiny.ours, ids, max_new_tokens=2, do_sample=True, generator=torch.Generator().manual_seed(1))
    per_row = generate(tiny.ours, ids, max_new_tokens=2, do_sample=True, generator=[torch.Generator().manual_seed(1)])
    assert per_row.sequences.tolist() == seeded.sequences.tolist()
