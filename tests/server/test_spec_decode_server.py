"""``kvgen serve --speculative-config``: the same completions as the shared server (greedy and seeded, streamed and
not), drafts counted in /metrics, a bad config refused at the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
PROMPT = "one two three, one two three, one two three, one two"


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir, tmp_path_factory, launch_server):
    live = launch_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "spec.log", "--num-blocks", "256",
                         "--speculative-config", SPEC)
    yield live
    assert live.stop() == 0, live.log()[-3000:]


def _completion(url: str, **body) -> dict:
    r = httpx.post(url + "/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 40, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_equal_the_server_without_drafts_and_drafts_show_in_metrics(spec_server, server):
    before = spec_server.metrics()
    for body in ({"temperature": 0, "ignore_eos": True}, {"temperature": 0.8, "seed": 4, "ignore_eos": True, "logprobs": 2}):
        ours, theirs = _completion(spec_server.v1, **body), _completion(server.v1, **body)
        assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
        counts = ("prompt_tokens", "completion_tokens")  # cached_tokens: what each server's prefix cache held
        assert [ours["usage"][k] for k in counts] == [theirs["usage"][k] for k in counts]
        if "logprobs" in body:
            assert ours["choices"][0]["logprobs"]["tokens"] == theirs["choices"][0]["logprobs"]["tokens"]
        with httpx.stream("POST", spec_server.v1 + "/completions", timeout=60,
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "stream": True, **body}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == theirs["choices"][0]["text"]
    after = spec_server.metrics()
    drafts = after["kvgen:spec_decode_num_draft_tokens_total"] - before.get("kvgen:spec_decode_num_draft_tokens_total", 0)
    accepted = after["kvgen:spec_decode_num_accepted_tokens_total"] - before.get("kvgen:spec_decode_num_accepted_tokens_total", 0)
    assert drafts > 0 and 0 < accepted <= drafts
    assert "kvgen:spec_decode_num_draft_tokens_total" not in server.metrics()  # only with speculative decoding


def test_a_bad_speculative_config_is_one_line_and_exit_code_2(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "kvgen.cli", "serve", "--model", str(tiny_model_dir), "--speculative-config",
                        '{"method": "eagle", "num_speculative_tokens": 2}'], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "kvgen: error: --speculative-config method must be 'ngram' (no draft models here), got 'eagle'"
