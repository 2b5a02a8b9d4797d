"""``POST /v1/embeddings`` on the live tiny-model server: the ``openai`` client (base64 by default) and plain JSON
get transformers' normalized last hidden states of the same tokens; bad input is a 400 naming the field, and the
server goes on serving."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import torch.nn.functional as F
import transformers


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def _expected(hf_tiny, ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf_tiny.model(torch.tensor([ids])).last_hidden_state[0, -1]  # [C]: the last token's (pooling "last")
    return F.normalize(hidden[:dimensions], dim=0)


def test_openai_client_embeddings_match_transformers(client, hf_tiny, tiny_tokenizer):
    texts = ["The capital of France is", "hello"]
    r = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64 and decodes it
    assert r.object == "list" and r.model == "tiny" and [d.index for d in r.data] == [0, 1]
    ids = [tiny_tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for data, prompt in zip(r.data, ids, strict=True):
        torch.testing.assert_close(torch.tensor(data.embedding), _expected(hf_tiny, prompt), rtol=1e-5, atol=1e-5)
    cut = client.embeddings.create(model="tiny", input=ids[0], dimensions=8, encoding_format="float")
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding), _expected(hf_tiny, ids[0], 8), rtol=1e-5,
                               atol=1e-5)


def test_json_float_and_base64_carry_the_same_values(server, tiny_tokenizer):
    body = {"input": [[5, 6, 7], [8]]}
    floats = httpx.post(server.v1 + "/embeddings", json=body, timeout=30).json()
    packed = httpx.post(server.v1 + "/embeddings", json=body | {"encoding_format": "base64"}, timeout=30).json()
    import base64

    import numpy as np

    for f, b in zip(floats["data"], packed["data"], strict=True):
        assert isinstance(b["embedding"], str) and f["object"] == "embedding"
        assert np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4").tolist() == pytest.approx(f["embedding"])
    assert floats["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


def test_truncate_prompt_tokens_embeds_each_inputs_last_tokens(client, hf_tiny, tiny_tokenizer):
    """vLLM's extra: each input keeps its last k tokens (-1: the last max_model_len), and usage counts those."""
    texts = ["The capital of France is", "hello world again"]
    r = client.embeddings.create(model="tiny", input=texts, extra_body={"truncate_prompt_tokens": 2})
    ids = [tiny_tokenizer.encode(t)[-2:] for t in texts]
    assert r.usage.prompt_tokens == 4
    for data, prompt in zip(r.data, ids, strict=True):
        torch.testing.assert_close(torch.tensor(data.embedding), _expected(hf_tiny, prompt), rtol=1e-5, atol=1e-5)
    long = [7, 8] * 1100  # 2200 tokens, over the 2048-token context
    r = client.embeddings.create(model="tiny", input=[long], extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 2048
    torch.testing.assert_close(torch.tensor(r.data[0].embedding), _expected(hf_tiny, long[-2048:]), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": []}, "input", "non-empty list"),
    ({"input": [5, 100000]}, "input", "prompt_token_ids must be in"),
    ({"input": ["a", [1, 2]]}, "input", None),  # mixed kinds: not one of the input forms
    ({"input": "a", "dimensions": 65}, "dimensions", "dimensions must be <= the model's hidden size (64)"),
    ({"input": "a", "dimensions": 0}, "dimensions", None),
    ({"input": [7] * 2049}, "input", "exceeds max_model_len (2048)"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": ["a"] * 2049}, "input", "input holds at most 2048 inputs, got 2049"),
    ({"input": ""}, "input", "input is empty"),
    ({"input": ["a", ""]}, "input", "input 1 is empty"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "got 0"),
    ({"input": "a", "truncate_prompt_tokens": 2049}, "truncate_prompt_tokens", "<= max_model_len (2048), got 2049"),
])
def test_bad_embedding_requests_are_400_naming_the_field(server, client, body, param, message):
    r = httpx.post(server.v1 + "/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "")
    assert message is None or message in error["message"]
    assert client.embeddings.create(model="tiny", input="still serving").data  # nothing broke


@pytest.fixture(scope="module")
def bos_server(tiny_model_dir, tmp_path_factory, launch_server):
    """The tiny model with a tokenizer whose post-processor prepends BOS (``<|im_start|>``, id 1), as Llama's."""
    import shutil

    from tokenizers import Tokenizer, processors

    path = tmp_path_factory.mktemp("bos-model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())  # model_type llama: LlamaTokenizerFast, which
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True}))  # adds BOS as this says
    live = launch_server(path, tmp_path_factory.mktemp("logs") / "bos.log", "--num-blocks", "256")
    yield live
    assert live.stop() == 0, live.log()[-3000:]


def test_add_special_tokens_false_embeds_the_text_without_bos(bos_server, hf_tiny, tiny_tokenizer):
    """vLLM's ``add_special_tokens`` (default true) on text inputs: false embeds the text's own tokens, no BOS."""
    text = "The capital of France is"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    with_bos = httpx.post(bos_server.v1 + "/embeddings", json={"input": text}, timeout=30).json()
    plain = httpx.post(bos_server.v1 + "/embeddings", json={"input": [text], "add_special_tokens": False},
                       timeout=30).json()
    assert with_bos["usage"]["prompt_tokens"] == len(ids) + 1 and plain["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(torch.tensor(with_bos["data"][0]["embedding"]), _expected(hf_tiny, [1, *ids]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(plain["data"][0]["embedding"]), _expected(hf_tiny, ids), rtol=1e-5,
                               atol=1e-5)


def test_another_models_name_is_404(server):
    r = httpx.post(server.v1 + "/embeddings", json={"model": "gpt-4", "input": "a"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_embeddings_count_in_the_metrics(server, client):
    before = server.metrics()
    r = client.embeddings.create(model="tiny", input=["one two three", "four"])
    after = server.metrics()
    assert after["kvgen:prompt_tokens_total"] - before["kvgen:prompt_tokens_total"] == r.usage.prompt_tokens > 0
    stop = 'kvgen:request_success_total{finished_reason="stop",model_name="tiny"}'
    assert after[stop] - before.get(stop, 0.0) == 1


def test_messages_embed_the_chat_templates_rendering(bos_server, hf_tiny, tiny_tokenizer):
    """vLLM's ``EmbeddingChatRequest``: ``messages`` instead of ``input`` embed the template's rendering, without the
    generation prompt and without the tokenizer's BOS unless ``add_special_tokens`` (or ``add_generation_prompt``)
    says so."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)  # the ChatML template
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    prompt = tiny_tokenizer.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)
    for extra, want in [({}, ids), ({"add_generation_prompt": True}, prompt), ({"add_special_tokens": True}, [1, *ids])]:
        r = httpx.post(bos_server.v1 + "/embeddings", json={"messages": messages, **extra}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1 and r.json()["usage"]["prompt_tokens"] == len(want)
        torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), _expected(hf_tiny, want),
                                   rtol=1e-5, atol=1e-5)
    for body in ({"input": "a", "messages": messages}, {}):
        r = httpx.post(bos_server.v1 + "/embeddings", json=body, timeout=30)
        assert r.status_code == 400 and "exactly one of input and messages" in r.json()["error"]["message"]
    r = httpx.post(bos_server.v1 + "/embeddings", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_text_of_no_token_without_special_tokens_is_named_empty(tiny_model_dir):
    """With ``add_special_tokens: false`` a text can tokenize to nothing (whitespace to a WordPiece vocabulary; here
    the tokenizer is made to): the 400 says the input is empty, where it named ``prompt_token_ids``, a field the
    request does not have."""
    import asyncio

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server.app import build_app

    async def run() -> httpx.Response:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_blocks=16))
        engine.engine.tokenizer.encode = lambda text, add_special_tokens=True: []  # type: ignore[method-assign]
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "tiny")),
                                         base_url="http://kvgen") as client:
                return await client.post("/v1/embeddings", json={"model": "tiny", "input": ["a", " "],
                                                                 "add_special_tokens": False})
        finally:
            await engine.shutdown()

    r = asyncio.run(run())
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert r.json()["error"]["message"] == "input 0 is empty: it holds no token", r.text
