"""The chat page in headless Chromium (Debian's ``chromium``, driven by Playwright through
``executable_path``; Playwright's own browser download is never used): type a message, see a
streamed reply and the tokens/s line appear, keep the conversation for a second turn. A
screenshot is saved under ``test-artifacts/`` (or ``$KVGEN_TEST_ARTIFACTS``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a headless browser: ~8 s to start

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("KVGEN_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM} (.ci/run installs it with apt-get)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser, server):
    page = browser.new_page()
    requests_outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(server.url) else requests_outside.append(r.url))
    page.goto(server.url + "/", timeout=TIMEOUT_MS)
    yield page, requests_outside
    page.close()


@pytest.fixture
def fresh_page(browser, server):
    """A page of its own, loaded, the model's name shown; its chat requests ignore EOS (a long reply to stop)."""
    page = browser.new_page()
    page.route("**/v1/chat/completions", lambda route: route.continue_(
        post_data=json.dumps({**route.request.post_data_json, "ignore_eos": True})))
    page.goto(server.url + "/", timeout=TIMEOUT_MS)
    page.wait_for_function("document.getElementById('model').textContent.includes('tiny')", timeout=TIMEOUT_MS)
    yield page
    page.close()


def _send(page, text: str, turn: int) -> str:
    page.fill("#input", text)
    page.press("#input", "Enter")
    reply = page.locator(".message.assistant").nth(turn)
    reply.wait_for(timeout=TIMEOUT_MS)
    page.wait_for_function(
        f"document.querySelectorAll('.message.assistant')[{turn}].dataset.state === 'done'", timeout=TIMEOUT_MS
    )
    return reply.inner_text()


def test_chat_page_streams_a_reply_and_keeps_the_conversation(page, server):
    page, requests_outside = page
    page.wait_for_function("document.getElementById('model').textContent.includes('tiny')", timeout=TIMEOUT_MS)
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    first = _send(page, "Hello, who are you?", 0)
    assert first and "[error]" not in first  # greedy on random weights: may be only whitespace
    stats = page.inner_text("#stats")
    assert stats.startswith("12 tokens") and "tokens/s" in stats  # completion tokens from the usage chunk
    page.fill("#temperature", "1")
    second = _send(page, "And again?", 1)
    assert second.strip() and "[error]" not in second
    users = page.locator(".message.user").all_inner_texts()
    assert users == ["Hello, who are you?", "And again?"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)
    assert (ARTIFACTS / "chat_page.png").stat().st_size > 1000
    assert requests_outside == []  # nothing fetched from outside the server
    # the second turn sent the whole conversation: the server logged a longer prompt
    assert server.log().count("completion_tokens=") >= 2


def test_new_chat_during_a_stream_aborts_it_and_starts_empty(fresh_page, server):
    page = fresh_page
    page.fill("#max-tokens", "1500")
    page.fill("#input", "Tell me a long story")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant').textContent.length > 0", timeout=TIMEOUT_MS)
    page.click("#clear")  # while the 1500 tokens stream
    server.wait_metric("kvgen:num_requests_running", lambda n: n == 0)  # the aborted request was freed
    page.wait_for_function("!document.getElementById('send').disabled", timeout=TIMEOUT_MS)
    page.fill("#max-tokens", "2")
    with page.expect_request("**/v1/chat/completions") as request:
        _send(page, "A new topic", 0)
    # the new chat holds only its own message, not the reply the click cut off
    assert request.value.post_data_json["messages"] == [{"role": "user", "content": "A new topic"}]


def test_enter_that_confirms_an_input_method_composition_does_not_send(fresh_page):
    page = fresh_page
    page.fill("#input", "にほんご")
    page.eval_on_selector("#input", """input => input.dispatchEvent(new KeyboardEvent("keydown",
        {key: "Enter", keyCode: 229, isComposing: true, bubbles: true, cancelable: true}))""")
    assert page.locator(".message").count() == 0  # a send adds the messages inside the key handler
    assert page.input_value("#input") == "にほんご"
    page.fill("#max-tokens", "2")
    assert "[error]" not in _send(page, "にほんご", 0)  # a plain Enter still sends


def test_a_server_with_an_api_key_says_so_until_the_page_has_it(browser, tiny_model_dir, tmp_path, launch_server):
    live = launch_server(tiny_model_dir, tmp_path / "server.log", "--api-key", "sesame")
    try:
        page = browser.new_page()
        page.goto(live.url + "/", timeout=TIMEOUT_MS)
        # the model line shows the 401's message, not a made-up model name
        page.wait_for_function("!document.getElementById('model').textContent.endsWith('…')", timeout=TIMEOUT_MS)
        assert "Incorrect API key" in page.inner_text("#model")
        page.fill("#max-tokens", "2")
        assert "[error] Incorrect API key" in _send(page, "Hello", 0)
        page.fill("#api-key", "sesame")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.getElementById('model').textContent === 'model: tiny'", timeout=TIMEOUT_MS)
        assert "[error]" not in _send(page, "Hello", 1)
        page.close()
    finally:
        assert live.stop() == 0


def test_an_empty_setting_is_left_to_the_server(fresh_page):
    """An emptied temperature or max-tokens field is left out of the request (the server's default applies); the page
    sent ``Number("")``, 0: a silently greedy reply, and a ``max_tokens`` of 0."""
    bodies: list[dict] = []
    fresh_page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    fresh_page.fill("#temperature", "")
    fresh_page.fill("#max-tokens", " ")
    _send(fresh_page, "Hi", 0)
    assert bodies and "temperature" not in bodies[0] and "max_tokens" not in bodies[0]
    fresh_page.fill("#temperature", "0.7")
    fresh_page.fill("#max-tokens", "3")
    _send(fresh_page, "Again", 1)
    assert bodies[-1]["temperature"] == 0.7 and bodies[-1]["max_tokens"] == 3
