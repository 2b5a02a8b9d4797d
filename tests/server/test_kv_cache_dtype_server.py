"""``kvgen serve --kv-cache-dtype int8`` (vLLM's flag) on a model that runs on the kernels: it answers, and
``/metrics`` names the pool's dtype in ``kvgen:cache_config_info`` as vLLM's ``cache_config_info`` does."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def int8_server(tiny_model_dir, tmp_path_factory, launch_server):
    live = launch_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "int8.log", "--quantization", "q8_0",
                         "--kv-cache-dtype", "int8", "--num-blocks", "64", "--block-size", "16")
    yield live
    assert live.stop() == 0, live.log()[-3000:]


def test_an_int8_pool_serves_and_says_so_in_metrics(int8_server):
    r = httpx.post(int8_server.v1 + "/completions", timeout=60,
                   json={"model": "tiny", "prompt": "one two three " * 10, "max_tokens": 20, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 20
    text = httpx.get(int8_server.url + "/metrics", timeout=10).text
    info = [line for line in text.splitlines() if line.startswith("kvgen:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0"), info
    for label in ('block_size="16"', 'cache_dtype="int8"', 'enable_prefix_caching="True"', 'num_gpu_blocks="64"'):
        assert label in info[0], info


def test_the_default_pool_says_auto(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'cache_dtype="auto"' in next(line for line in text.splitlines() if line.startswith("kvgen:cache_config_info{"))
