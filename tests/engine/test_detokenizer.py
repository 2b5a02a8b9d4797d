"""kvgen.engine.detokenizer and kvgen.engine.output_processor: text, stop strings with hold-back, outputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_cases import (
    CONVERSATIONS,
    HARD_STRINGS,
    WORDPIECE_VOCAB,
    ref_decode,
    write_wordpiece_dir,
)
from tokenizers.decoders import DecodeStream
from transformers import BertTokenizer, PreTrainedTokenizerBase
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from kvgen.engine.block_manager import BlockManager
from kvgen.engine.detokenizer import IncrementalDetokenizer, RequestDetokenizer
from kvgen.engine.output_processor import OutputProcessor
from kvgen.engine.request import Request, RequestStatus
from kvgen.engine.sampling_params import RequestOutputKind, SamplingParams
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.types import EngineCoreOutput, Logprob, ModelRunnerOutput
from kvgen.sampling.stopping import find_stop_string
from kvgen.tokenizer import Tokenizer
from kvgen.weights.gguf_file import gguf_metadata, open_gguf

EOS = 0
# Multi-character pieces so stop strings span token boundaries; " é" and "€!" are multi-byte.
MERGED = ["hel", "lo", " wor", "ld", "##", "STOP", "ST", "OP", " é", "€!"]
PIECES = MERGED + ["#", "S", "T", "O", "P", "x"]
BYTE = bytes_to_unicode()
FIRST_MERGED = 257  # after <|eos|> and the 256 single bytes


def piece_id(piece: str) -> int:
    if piece in MERGED:
        return FIRST_MERGED + MERGED.index(piece)
    (byte,) = piece.encode()
    return 1 + byte


def ids_of(*pieces: str) -> list[int]:
    return [piece_id(p) for p in pieces]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    pieces = ["".join(BYTE[b] for b in p.encode()) for p in MERGED]
    tokens = ["<|eos|>"] + [BYTE[b] for b in range(256)] + pieces
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": EOS,
    }
    return Tokenizer.from_gguf(meta)


def make_request(request_id: str = "a", **params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(
        request_id=request_id,
        prompt="hi",
        prompt_token_ids=ids_of("x", "x"),
        sampling_params=SamplingParams(**params),
        eos_token_ids=(EOS,),
    )


def stream(tokenizer, token_ids: list[int], finish_last: str | None = "length", **params):
    """Feed one token per step as the scheduler would; return the processor's outputs."""
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(output_kind=RequestOutputKind.DELTA, **params))
    outputs = []
    for i, token_id in enumerate(token_ids):
        is_last = i == len(token_ids) - 1
        core = EngineCoreOutput("a", [token_id], finish_reason=finish_last if is_last else None,
                                is_stop_token=is_last and finish_last == "stop")
        processed = processor.process_outputs([core])
        outputs.extend(processed.request_outputs)
        if processed.stopped_request_ids:
            assert processed.stopped_request_ids == ["a"]
            break
    assert outputs[-1].finished and not processor.has_unfinished_requests()
    return outputs


# ---------------------------------------------------------------- stop strings


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer) -> None:
    outputs = stream(tokenizer, ids_of("hel", "lo", " wor", "ld", "x"), stop="lo w")
    deltas = [o.outputs[0].text for o in outputs]
    assert deltas == ["he", "l", ""]  # "l", then "lo" may start "lo w": held back; then dropped
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "lo w")
    assert final.token_ids == ids_of(" wor")  # DELTA: ids of this step; generation stopped here


def test_include_stop_str_in_output(tokenizer) -> None:
    outputs = stream(tokenizer, ids_of("hel", "lo", " wor", "ld"), stop=["lo w"], include_stop_str_in_output=True)
    assert "".join(o.outputs[0].text for o in outputs) == "hello w"


def test_held_back_text_is_released_when_no_stop_completes(tokenizer) -> None:
    outputs = stream(tokenizer, ids_of("hel", "lo"), stop="lox")
    assert [o.outputs[0].text for o in outputs] == ["he", "llo"]  # the last "lo" goes out at the end
    assert outputs[-1].outputs[0].finish_reason == "length"
    outputs = stream(tokenizer, ids_of("hel", "lo", "ld", "x"), stop="lox")
    assert [o.outputs[0].text for o in outputs] == ["he", "l", "lold", "x"]


def test_earliest_and_shortest_stop_string_wins(tokenizer) -> None:
    outputs = stream(tokenizer, ids_of("##", "STOP", "x"), stop=["STOP", "#S", "##STOPx"])
    assert outputs[-1].outputs[0].text == "#" and outputs[-1].outputs[0].stop_reason == "#S"


def test_min_tokens_holds_back_stop_strings_in_its_text_as_vllm(tokenizer) -> None:
    """vLLM (PR 22014): the first min_tokens tokens' text is not searched, but a stop string ending later is."""
    ids = ids_of("hel", "lo", " wor", "ld", "x")

    def run(**params) -> tuple[str, str | int | None, str | None]:
        outputs = stream(tokenizer, ids, **params)
        final = outputs[-1].outputs[0]
        return "".join(o.outputs[0].text for o in outputs), final.stop_reason, final.finish_reason

    assert run(stop="l") == ("he", "l", "stop")
    assert run(stop="l", min_tokens=2) == ("hello wor", "l", "stop")
    assert run(stop="l", min_tokens=5) == ("hello world" + "x", None, "length")
    assert run(stop="lo w", min_tokens=2) == ("hel", "lo w", "stop")  # begins in the held text, ends after it


def test_min_tokens_text_is_not_searched_through_a_longer_stop_strings_window(tokenizer) -> None:
    """vLLM's check_stop_strings looks back len(stop) - 1 characters per stop string: a stop string wholly inside
    the first min_tokens tokens' text is never found, even when a longer stop string is asked for too."""
    ids = ids_of("hel", "lo", " wor", "ld", "x")
    held = tokenizer.decode(ids[:2])
    assert "e" in held and "l" in held
    outputs = stream(tokenizer, ids, stop=["e", "zzzzz"], min_tokens=2)
    final = outputs[-1].outputs[0]
    assert ("".join(o.outputs[0].text for o in outputs), final.finish_reason) == (tokenizer.decode(ids), "length")
    outputs = stream(tokenizer, ids, stop=["l", "lo w"], min_tokens=2)
    final = outputs[-1].outputs[0]
    assert ("".join(o.outputs[0].text for o in outputs), final.stop_reason) == (held[: held.index("lo")], "lo w")


@pytest.mark.parametrize("params", [dict(stop="lo w"), dict(stop="l", min_tokens=2), dict(stop="e", min_tokens=1),
                                    dict(stop=["STOP"], include_stop_str_in_output=True)])
def test_a_multi_token_step_with_stop_strings_ends_as_one_token_steps_do(tokenizer, params) -> None:
    """Several ids in one step (kept speculative drafts) go through the stop strings one at a time: the text, ids,
    logprobs and stop string are those of feeding the same ids one per step (vLLM's detokenizer), the ids after the
    match dropped."""
    ids = ids_of("hel", "lo", " wor", "ld", "STOP", "x")
    one_by_one = stream(tokenizer, ids, **params)
    final = one_by_one[-1].outputs[0]
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=0, **params))
    logprobs = [{t: Logprob(-float(i), 1)} for i, t in enumerate(ids)]
    step = EngineCoreOutput("a", list(ids), logprobs, finish_reason="length")
    (out,) = processor.process_outputs([step]).request_outputs
    c = out.outputs[0]
    assert (c.text, c.stop_reason) == ("".join(o.outputs[0].text for o in one_by_one), final.stop_reason)
    num = sum(len(o.outputs[0].token_ids) for o in one_by_one)
    assert c.token_ids == ids[:num] and [list(p) for p in c.logprobs] == [[t] for t in ids[:num]]


def test_stop_token_text_is_dropped_unless_included(tokenizer) -> None:
    ids = ids_of("hel", "lo") + [EOS]
    outputs = stream(tokenizer, ids, finish_last="stop", skip_special_tokens=False)
    assert "".join(o.outputs[0].text for o in outputs) == "hello"
    ids = ids_of("hel", "lo", "STOP")
    for include, text in ((False, "hello"), (True, "helloSTOP")):
        outputs = stream(tokenizer, ids, finish_last="stop", include_stop_str_in_output=include)
        assert "".join(o.outputs[0].text for o in outputs) == text


def test_multibyte_characters_are_held_until_complete(tokenizer) -> None:
    e_acute = list(" é".encode())  # 3 single-byte tokens: b" ", 0xC3, 0xA9
    ids = [1 + b for b in e_acute] + ids_of("€!")
    outputs = stream(tokenizer, ids)
    assert [o.outputs[0].text for o in outputs] == [" ", "", "é", "€!"]


def test_detokenizer_without_tokenizer_keeps_ids_only() -> None:
    detokenizer = RequestDetokenizer(None, [1, 2], SamplingParams())
    assert detokenizer.update([5, 6], finished=True) is None and detokenizer.text == ""
    with pytest.raises(ValueError, match=r"stop strings need a tokenizer, got stop=\['x'\]"):
        RequestDetokenizer(None, [1], SamplingParams(stop="x"))


STOPS = ["lo w", "##S", "OPST", "TOP", "é€", "d#", "Sx"]


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12),
    stops=st.lists(st.sampled_from(STOPS), max_size=3),
    include=st.booleans(),
)
def test_streamed_text_never_leaks_a_stop_string(tokenizer, pieces, stops, include) -> None:
    ids = ids_of(*pieces)
    outputs = stream(tokenizer, ids, stop=stops, include_stop_str_in_output=include)
    deltas = [o.outputs[0].text for o in outputs]
    full = tokenizer.decode(ids)
    match = find_stop_string(full, stops) if stops else None
    expected = full if match is None else full[: match[0] + (len(match[1]) if include else 0)]
    assert "".join(deltas) == expected
    streamed = "".join(deltas[:-1])  # what went out before the final output
    assert expected.startswith(streamed)
    if not include:
        assert all(s not in "".join(deltas) for s in stops)
    final = outputs[-1].outputs[0]
    assert final.stop_reason == (None if match is None else match[1])


# ---------------------------------------------------------------- outputs


def test_cumulative_and_final_only_outputs(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("cum", stop="low"))
    processor.add_request(make_request("fin", output_kind=RequestOutputKind.FINAL_ONLY))
    texts = []
    for i, piece in enumerate(["hel", "lo", "ld"]):
        finish = "length" if i == 2 else None
        core = [EngineCoreOutput(rid, [piece_id(piece)], finish_reason=finish) for rid in ("cum", "fin")]
        outs = processor.process_outputs(core).request_outputs
        texts.append([(o.request_id, o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs])
    assert texts == [[("cum", "he", 1)], [("cum", "hel", 2)], [("cum", "hellold", 3), ("fin", "hellold", 3)]]


def test_request_output_fields_logprobs_and_metrics(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = make_request(logprobs=1)
    processor.add_request(request)
    hel, lo, x = piece_id("hel"), piece_id("lo"), piece_id("x")
    lps = [{hel: Logprob(-0.5, 1)}, {lo: Logprob(-0.25, 2), x: Logprob(-0.2, 1)}]
    processor.process_outputs([EngineCoreOutput("a", ids_of("hel"), [lps[0]])])
    (out,) = processor.process_outputs(
        [EngineCoreOutput("a", ids_of("lo"), [lps[1]], finish_reason="stop", stop_reason=piece_id("lo"), is_stop_token=True)]
    ).request_outputs
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == ("a", "hi", ids_of("x", "x"), True)
    c = out.outputs[0]
    assert (c.index, c.text, c.token_ids) == (0, "hel", ids_of("hel", "lo"))  # the stop token's text is left out
    assert (c.cumulative_logprob, c.finish_reason, c.stop_reason) == (-0.75, "stop", lo)  # the chosen ids' sum
    # vLLM's dicts, each id decoded alone (decoded_token) by the output processor
    assert c.logprobs == [{hel: Logprob(-0.5, 1, tokenizer.decode([hel]))},
                          {lo: Logprob(-0.25, 2, tokenizer.decode([lo])), x: Logprob(-0.2, 1, tokenizer.decode([x]))}]
    assert out.metrics.arrival_time == request.arrival_time and out.metrics.finish_time >= request.arrival_time
    assert out.metrics.last_token_time is not None and out.error is None


def test_ids_past_the_tokenizers_vocabulary_have_no_text_as_hf_decodes_them(tokenizer) -> None:
    """A model may pad its vocabulary past the tokenizer's (Qwen2.5: 151,936 rows, 151,665 tokens): such an id, sampled
    or among the top logprobs, decodes to nothing as HF's decode gives (vLLM's text), instead of failing the step."""
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_object=BackendTokenizer.from_str(tokenizer.backend_json()))
    padded = tokenizer.vocab_size + 3
    ids = [*ids_of("hel"), padded, *ids_of("lo", " wor"), padded]
    outputs = stream(tokenizer, ids, stop="o w", logprobs=0)
    assert "".join(o.outputs[0].text for o in outputs) == ref.decode(ids).split("o w")[0] == "hell"
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request(logprobs=1))
    position = {padded: Logprob(-0.5, 1), piece_id("x"): Logprob(-1.0, 2)}
    (out,) = processor.process_outputs([EngineCoreOutput("a", [padded], [position], finish_reason="length")]).request_outputs
    assert [lp.decoded_token for lp in out.outputs[0].logprobs[0].values()] == [ref.decode([padded]), ref.decode([piece_id("x")])]
    assert out.outputs[0].text == ref.decode([padded]) == ""


def test_abort_output_carries_the_error_and_no_logprobs_when_not_asked(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request())
    (out,) = processor.process_outputs(
        [EngineCoreOutput("a", [], finish_reason="abort", error="too big")]
    ).request_outputs
    c = out.outputs[0]
    assert (c.finish_reason, c.logprobs, c.cumulative_logprob, out.error) == ("abort", None, None, "too big")
    processor.add_request(make_request())  # the finished id can be used again
    with pytest.raises(AssertionError):  # LLMEngine.add_request refuses duplicates before this
        processor.add_request(make_request())


def test_engine_loop_finishes_stop_string_requests_in_the_scheduler(tokenizer) -> None:
    bm = BlockManager(32, 4)
    scheduler, processor = Scheduler(4, 64, bm), OutputProcessor(tokenizer)
    plan = {"a": ids_of("hel", "lo", " wor", "ld", "x", "x"), "b": ids_of("x", "ld", "x", "x", "lo", "x")}
    for rid in plan:
        request = make_request(rid, stop="lo w", max_tokens=6)
        scheduler.add_request(request), processor.add_request(request)
    finals = {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {s.request_id: [plan[s.request_id][len(s.output_token_ids)]] for s in out.scheduled if s.needs_sample}
        processed = processor.process_outputs(scheduler.update_from_output(out, ModelRunnerOutput(sampled)))
        scheduler.finish_requests(processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED)
        finals |= {o.request_id: o.outputs[0] for o in processed.request_outputs if o.finished}
    assert (finals["a"].text, finals["a"].finish_reason, finals["a"].token_ids) == ("hel", "stop", plan["a"][:3])
    assert (finals["b"].text, finals["b"].finish_reason) == ("xldxxlox", "length")
    assert bm.num_free_blocks == 32 and not processor.has_unfinished_requests()


# ---------------------------------------------------------------- IncrementalDetokenizer on the default GGUF


@pytest.fixture(scope="module")
def default_tokenizer(default_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_metadata(open_gguf(default_gguf_path)))


@pytest.fixture(scope="module")
def ref(hf_default_tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """transformers' tokenizer on the default GGUF (see tests/tokenizer for the ids it agrees on)."""
    return hf_default_tokenizer


def test_incremental_detokenizer_rejects_out_of_range_ids(default_tokenizer: Tokenizer) -> None:
    vocab_size = default_tokenizer.vocab_size
    with pytest.raises(ValueError, match=r"got -1"):
        IncrementalDetokenizer(default_tokenizer).add(-1)
    with pytest.raises(ValueError, match=rf"token id must be in \[0, {vocab_size}\), got {vocab_size}"):
        IncrementalDetokenizer(default_tokenizer, [1, vocab_size])


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_stream_never_splits_a_character(default_tokenizer: Tokenizer, ref: PreTrainedTokenizerBase) -> None:
    text = "👨‍👩‍👧‍👦 中文字符 🇫🇷 naïve ok! 日本語"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in ref.decode([i]) for i in ids)  # some tokens hold half a character
    detok = IncrementalDetokenizer(default_tokenizer)
    pieces = _stream(detok, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == detok.text == ref_decode(ref, ids, skip=True) == text
    assert detok.token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_stream_after_prompt_matches_decode(default_tokenizer: Tokenizer, ref: PreTrainedTokenizerBase, skip: bool) -> None:
    prompt = default_tokenizer.apply_chat_template(CONVERSATIONS["system"], add_generation_prompt=True, tokenize=True)
    ids = default_tokenizer.encode("  Hello there! 你好 🌍\n\tcode<|im_end|>\n<|im_start|>x", add_special_tokens=False)
    pieces = _stream(IncrementalDetokenizer(default_tokenizer, prompt, skip_special_tokens=skip), ids)
    assert "".join(pieces) == ref_decode(ref, ids, skip)
    chunked = IncrementalDetokenizer(default_tokenizer, prompt, skip_special_tokens=skip)
    assert chunked.add(ids[:7]) + chunked.add(ids[7:]) + chunked.flush() == "".join(pieces)


def test_stream_of_random_ids_matches_decode(default_tokenizer: Tokenizer, ref: PreTrainedTokenizerBase) -> None:
    """Arbitrary ids (stray UTF-8 bytes, specials, prompts ending mid-character) still add up."""
    rng = random.Random(0)
    byte_ids = [i for i in range(default_tokenizer.vocab_size) if len(ref.convert_ids_to_tokens(i)) == 1][:256]
    for _ in range(60):
        ids = [rng.choice(byte_ids) if rng.random() < 0.4 else rng.randrange(default_tokenizer.vocab_size) for _ in range(40)]
        prompt = [rng.randrange(default_tokenizer.vocab_size) for _ in range(rng.randrange(8))]
        skip = rng.random() < 0.5
        pieces = _stream(IncrementalDetokenizer(default_tokenizer, prompt, skip_special_tokens=skip), ids)
        assert "".join(pieces) == ref_decode(ref, ids, skip)


def _vllm_fast_text(ref: PreTrainedTokenizerBase, prompt: list[int], ids: list[int]) -> str:
    """vLLM's FastIncrementalDetokenizer: tokenizers' DecodeStream primed with the prompt's last ids (the first
    suffix of 4 to 23 ids that decodes without "\\ufffd", else the whole prompt), then stepped through ``ids``."""
    backend = ref._tokenizer
    suffix = prompt
    if len(prompt) > 4:
        fine = [prompt[-i:] for i in range(4, min(len(prompt) + 1, 24)) if "\ufffd" not in backend.decode(prompt[-i:])]
        suffix = fine[0] if fine else prompt
    stream = DecodeStream(skip_special_tokens=True)
    for i in suffix:
        stream.step(backend, i)
    return "".join(stream.step(backend, i) or "" for i in ids)


def test_a_character_the_prompt_leaves_unfinished_is_not_lost(default_tokenizer: Tokenizer,
                                                                ref: PreTrainedTokenizerBase) -> None:
    """The new ids that finish it emit the whole character, as vLLM's DecodeStream; one they do not finish shows as
    "\\ufffd" (it was dropped: its "\\ufffd" counted as prompt text already shown)."""
    byte_id = {token: i for i, token in enumerate(ref.convert_ids_to_tokens(list(range(ref.vocab_size))))}
    e_acute = [byte_id[BYTE[b]] for b in "é".encode()]
    ids = default_tokenizer.encode("Hello there, café 👋 ok", add_special_tokens=False)
    cuts = [cut for cut in range(1, len(ids)) if ref.decode(ids[:cut]).endswith("\ufffd")]
    cases = [(ids[:cut], ids[cut:]) for cut in cuts]
    words = default_tokenizer.encode("Hello caf", add_special_tokens=False)
    cases += [(words + e_acute[:1], e_acute[1:] + words), (words + e_acute[:1], words)]
    assert cuts and any(_vllm_fast_text(ref, p, g).startswith("é") for p, g in cases)
    for prompt, generated in cases:
        pieces = _stream(IncrementalDetokenizer(default_tokenizer, prompt), generated)
        assert "".join(pieces) == _vllm_fast_text(ref, prompt, generated)


def test_flush_emits_an_unfinished_character(default_tokenizer: Tokenizer, ref: PreTrainedTokenizerBase) -> None:
    partial = default_tokenizer.encode("ok 👨", add_special_tokens=False)[:-1]  # the emoji spans several tokens
    assert ref.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(default_tokenizer)
    streamed = detok.add(partial)
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert streamed + tail == detok.text == ref_decode(ref, partial, skip=True)


def test_stream_decodes_a_bounded_window(default_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    windows: list[int] = []
    original = IncrementalDetokenizer._decode

    def recording(self: IncrementalDetokenizer, start: int, end: int) -> str:
        windows.append(end - start)
        return original(self, start, end)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode", recording)
    ids = default_tokenizer.encode(" ".join(HARD_STRINGS) * 5, add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, list(range(100)))
    assert "".join(_stream(detok, ids)) == default_tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 500 and max(windows) <= 12


def _continuation(ref: BertTokenizer, prompt: list[int], ids: list[int], skip: bool) -> str:
    """What ``ids`` add to the decoded ``prompt`` (a space before a new word), cleaned up on their own."""
    whole, head = (ref.decode(t, skip_special_tokens=skip, clean_up_tokenization_spaces=False) for t in (prompt + ids, prompt))
    assert whole.startswith(head)
    return BertTokenizer.clean_up_tokenization(whole[len(head) :])


@pytest.mark.parametrize("skip", [True, False])
def test_stream_of_wordpiece_ids_matches_bert_decode(tmp_path: Path, skip: bool) -> None:
    """A WordPiece stream: "##" pieces glue, specials and the clean-up (" ' " -> "'") add up to BertTokenizer.decode."""
    directory = write_wordpiece_dir(tmp_path, WORDPIECE_VOCAB, do_lower_case=True)
    ours, ref = Tokenizer.from_pretrained(directory), BertTokenizer(str(directory / "vocab.txt"))
    rng = random.Random(1)
    quote, pieces = ours.token_to_id("'"), [i for i, t in enumerate(WORDPIECE_VOCAB) if t.startswith("##")]
    for _ in range(100):
        ids = [rng.choice([quote, rng.choice(pieces), rng.randrange(ours.vocab_size)]) for _ in range(30)]
        stream = "".join(_stream(IncrementalDetokenizer(ours, [], skip_special_tokens=skip), ids))
        assert stream == ref.decode(ids, skip_special_tokens=skip), ids
        prompt = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 6))]
        stream = "".join(_stream(IncrementalDetokenizer(ours, prompt, skip_special_tokens=skip), ids))
        assert stream == _continuation(ref, prompt, ids, skip), (prompt, ids)
    hello, s_piece = ours.encode("hello", add_special_tokens=False), [WORDPIECE_VOCAB.index("##s")]
    glued = IncrementalDetokenizer(ours, hello, skip_special_tokens=skip)
    assert glued.add(s_piece) + glued.flush() == "s" == _continuation(ref, hello, s_piece, skip)


def _vllm_update_text(ids: list[int], chunks: list[int], decode, stop: str, min_tokens: int) -> tuple[str, str | None]:
    """vLLM v1's ``IncrementalDetokenizer.update`` (vllm/v1/engine/detokenizer.py) with its ``check_stop_strings``
    for one stop string, fed ``chunks[k]`` ids per call: the text of the first min_tokens ids moves the search start
    (``stop_check_offset``), and the search looks back len(stop) - 1 characters before the new text."""
    text, num_ids = "", 0
    for size in chunks:
        stop_check_offset = len(text)
        for _ in range(size):
            num_ids += 1
            text = decode(ids[:num_ids])  # these pieces are whole characters: the incremental text is the decode
            if min_tokens and num_ids <= min_tokens:
                stop_check_offset = len(text)
        new_char_count = len(text) - stop_check_offset
        if num_ids > min_tokens and new_char_count:
            if (index := text.find(stop, 1 - new_char_count - len(stop))) != -1:
                return text[:index], stop
    return text, None


@pytest.mark.parametrize(("stop", "min_tokens", "chunks"), [
    ("lo", 2, [1, 1, 1, 1, 1]),  # "lo" ends exactly where the min_tokens text ends: never found
    ("l", 2, [5]),  # one update with every id: the first 2 ids' "l"s are not searched
    ("lo w", 2, [5]), ("l", 1, [2, 3]), ("o", 3, [2, 1, 2]),
])
def test_stop_strings_at_the_min_tokens_edge_match_vllms_detokenizer(tokenizer, stop, min_tokens, chunks) -> None:
    ids = ids_of("hel", "lo", " wor", "ld", "x")
    detokenizer = RequestDetokenizer(tokenizer, ids_of("x"), SamplingParams(stop=stop, min_tokens=min_tokens))
    start, matched = 0, None
    for size in chunks:
        matched = detokenizer.update(ids[start : start + size])
        start += size
        if matched is not None:
            break
    assert (detokenizer.text, matched) == _vllm_update_text(ids, chunks, tokenizer.decode, stop, min_tokens)


def test_the_first_id_past_the_tokenizers_vocabulary_has_no_text_either(tokenizer) -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_object=BackendTokenizer.from_str(tokenizer.backend_json()))
    ids = [*ids_of("hel"), tokenizer.vocab_size, *ids_of("lo")]
    detokenizer = RequestDetokenizer(tokenizer, ids_of("x"), SamplingParams(stop="zz"))
    for token_id in ids:
        detokenizer.update([token_id])
    detokenizer.update([], finished=True)
    assert detokenizer.get_text(finished=True) == ref.decode(ids) == "hello"
