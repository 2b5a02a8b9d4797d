"""``kvgen serve`` takes the model directory's generation_config.json as the defaults of unset request fields and
caps max_tokens at its max_new_tokens (vLLM's ``--generation-config auto``); ``--override-generation-config``; a
request's ``priority`` under ``--scheduling-policy priority``."""

from __future__ import annotations

import json
import shutil

import openai


def test_unset_fields_take_the_models_generation_config(tiny_model_dir, tmp_path, launch_server):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "repetition_penalty": 1.8, "max_new_tokens": 30}))
    live = launch_server(model_dir, tmp_path / "server.log", "--override-generation-config", '{"max_new_tokens": 6}',
                         "--scheduling-policy", "priority")
    try:
        assert "sampling defaults from the model's generation config" in live.log()
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
        prompt = "hello world hello world"

        def complete(repetition_penalty: float | None = None, **fields):
            extra = {"ignore_eos": True} | ({} if repetition_penalty is None else {"repetition_penalty": repetition_penalty})
            return client.completions.create(model=live.model_name, prompt=prompt, extra_body=extra, **fields)

        default = complete()  # greedy with the penalty; 6 tokens (the override over the file's 30)
        assert default.usage.completion_tokens == 6 and default.choices[0].finish_reason == "length"
        assert default.choices[0].text == complete(1.8, temperature=0, max_tokens=6).choices[0].text
        assert default.choices[0].text != complete(1.0, temperature=0, max_tokens=6).choices[0].text
        assert complete(max_tokens=20).usage.completion_tokens == 6  # capped, as vLLM
        # --scheduling-policy priority: the vLLM extra `priority` is taken (the shared fcfs server refuses it)
        with_priority = client.completions.create(model=live.model_name, prompt=prompt,
                                                  extra_body={"priority": -3, "ignore_eos": True})
        assert with_priority.choices[0].text == default.choices[0].text
    finally:
        assert live.stop() == 0
