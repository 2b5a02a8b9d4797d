"""``use_beam_search`` on a live ``kvgen serve`` (tiny random model): the choices are ``LLM.beam_search``'s beams,
streamed or not, with their logprobs; settings beam search would ignore are a 400 naming them."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers import save_tiny_model_dir

from kvgen.engine import LLM, BeamSearchParams

PROMPT = "The colour of the sky is"
BEAMS = {"n": 3, "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tiny_tokenizer):
    """LLM.beam_search's 3 best beams of PROMPT: (new ids, text without special tokens, cumulative logprob)."""
    prompt = tiny_tokenizer.encode(PROMPT)
    out = LLM(str(tiny_model_dir), num_blocks=256).beam_search(
        prompt, BeamSearchParams(beam_width=3, max_tokens=6, temperature=0.0))[0]
    return [(s.tokens[len(prompt):], tiny_tokenizer.decode(s.tokens[len(prompt):], skip_special_tokens=True),
             s.cum_logprob) for s in out.sequences]


def test_completion_choices_are_the_beams_with_their_logprobs(server, expected):
    body = {"model": "tiny", "prompt": PROMPT, "use_beam_search": True, "logprobs": 2, **BEAMS}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=60).json()
    assert [c["text"] for c in r["choices"]] == [text for _, text, _ in expected]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for choice, (ids, _, cum) in zip(r["choices"], expected, strict=True):
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(ids) and sum(logprobs) == pytest.approx(cum, abs=1e-4)
        assert choice["finish_reason"] == ("stop" if len(ids) < BEAMS["max_tokens"] else "length")
    assert r["usage"]["completion_tokens"] == sum(len(ids) for ids, _, _ in expected)


def test_streamed_chat_beam_search_equals_the_answer_at_once(client):
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "Name a colour."}],
              "extra_body": {"use_beam_search": True, "length_penalty": 0.5}, **BEAMS}
    whole = client.chat.completions.create(**kwargs)
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert len({c.message.content for c in whole.choices}) > 1  # three different beams


@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": ["."]}, "stop"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 11}, "n"),
    ({"echo": True, "logprobs": 1}, "echo"),
])
def test_settings_beam_search_would_ignore_are_refused(server, extra, param):
    body = {"model": "tiny", "prompt": PROMPT, "use_beam_search": True, **BEAMS, **extra}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server.v1 + "/completions", json={**body, **BEAMS, "stop": None, "repetition_penalty": None,
                                                     "response_format": None, "echo": False, "logprobs": None},
                    timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3  # the server goes on serving


@pytest.fixture(scope="module")
def eos_server(tmp_path_factory, launch_server):
    """A server of a tiny model whose EOS logit is the most likely first token's after PROMPT (lm_head row copied),
    so beams end on EOS; (server, directory, tokenizer)."""
    import transformers

    from kvgen.tokenizer import Tokenizer

    path = save_tiny_model_dir(tmp_path_factory.mktemp("eos-tiny"), tie=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok = Tokenizer.from_pretrained(path)
    with torch.no_grad():
        top = int(ref(torch.tensor([tok.encode(PROMPT)])).logits[0, -1].argmax())
        ref.lm_head.weight[tok.eos_token_id] = ref.lm_head.weight[top]
    ref.save_pretrained(path, safe_serialization=True)
    live = launch_server(path, tmp_path_factory.mktemp("logs") / "eos-server.log", "--num-blocks", "256")
    yield live, path, tok
    assert live.stop() == 0, live.log()[-3000:]


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_final_eos_is_in_the_token_ids_only_with_include_stop_str_in_output(eos_server, include_stop_str_in_output):
    """vLLM's serving beam_search: an EOS-ended beam's token ids (so logprobs and usage) drop the EOS unless
    include_stop_str_in_output; its text never has it."""
    live, path, tok = eos_server
    prompt = tok.encode(PROMPT)
    beams = LLM(str(path), num_blocks=256).beam_search(prompt, BeamSearchParams(
        beam_width=3, max_tokens=4, length_penalty=0.0))[0].sequences
    assert any(s.tokens[-1] == tok.eos_token_id for s in beams)
    want = []
    for s in beams:
        ids = s.tokens[len(prompt):]
        is_eos = ids[-1] == tok.eos_token_id
        kept = ids if include_stop_str_in_output or not is_eos else ids[:-1]
        want.append((tok.decode(ids[:-1] if is_eos else ids, skip_special_tokens=True), len(kept),
                     "stop" if is_eos else "length"))
    body = {"model": "tiny", "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 4, "temperature": 0,
            "length_penalty": 0.0, "logprobs": 1, "include_stop_str_in_output": include_stop_str_in_output}
    r = httpx.post(live.v1 + "/completions", json=body, timeout=60).json()
    assert [(c["text"], len(c["logprobs"]["tokens"]), c["finish_reason"]) for c in r["choices"]] == want
    assert r["usage"]["completion_tokens"] == sum(num_ids for _, num_ids, _ in want)


def test_an_eos_ended_beam_names_its_eos_as_stop_reason(eos_server):
    """vLLM's serving beam_search sets stop_reason = eos_token_id on a beam completed by EOS (null on the others),
    answered or streamed."""
    live, path, tok = eos_server
    prompt = tok.encode(PROMPT)
    beams = LLM(str(path), num_blocks=256).beam_search(prompt, BeamSearchParams(
        beam_width=3, max_tokens=4, length_penalty=0.0))[0].sequences
    want = [tok.eos_token_id if s.tokens[-1] == tok.eos_token_id else None for s in beams]
    assert tok.eos_token_id in want
    body = {"model": "tiny", "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 4, "temperature": 0,
            "length_penalty": 0.0}
    r = httpx.post(live.v1 + "/completions", json=body, timeout=60).json()
    assert [c["stop_reason"] for c in r["choices"]] == want
    streamed: dict[int, int | None] = {}
    with httpx.stream("POST", live.v1 + "/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c["finish_reason"] is not None:
                        streamed[c["index"]] = c["stop_reason"]
    assert [streamed[i] for i in range(3)] == want


def test_beam_search_after_the_shutdowns_abort_all_is_a_503_not_a_500(tiny_model_dir):
    """In process: beam search adds an engine request per step, so the shutdown's ``abort_all`` reaches it at
    ``add_request`` (``EngineStoppedError``): answered 503 "aborted", streamed as an "aborted" error event, as every
    other aborted request; it was a 500 "internal server error (EngineStoppedError)" with a logged traceback."""
    import asyncio

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server.app import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_blocks=64))
    app = build_app(engine, "tiny")
    body = {"model": "tiny", "prompt": PROMPT, "use_beam_search": True, **BEAMS}

    async def run() -> tuple[httpx.Response, httpx.Response]:
        engine.abort_all()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvgen") as client:
            plain = await client.post("/v1/completions", json=body, timeout=60)
            streamed = await client.post("/v1/completions", json=body | {"stream": True}, timeout=60)
        await engine.shutdown()
        return plain, streamed

    plain, streamed = asyncio.run(run())
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "aborted", plain.text
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events and events[-1]["error"]["code"] == "aborted", streamed.text
    assert app.state.kvgen.metrics.num_in_server == 0
