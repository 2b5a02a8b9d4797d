"""Live ``kvgen serve`` processes on 127.0.0.1 for the server tests.

Most tests talk to ``tiny_model_dir`` (tests/conftest.py): a tiny random Llama (2 layers,
hidden 64) with a small byte-level BPE tokenizer and a ChatML template, saved as a Hugging
Face directory, so a server starts in a few seconds and a step takes milliseconds. Every
server is a real subprocess on a free port (``--port 0``; the port is read from its first stderr line),
stopped with SIGTERM at the end of its fixture.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0
_LISTENING = re.compile(r"kvgen serve: model .* on (http://[\d.]+:\d+)")


@dataclass
class LiveServer:
    """A running ``kvgen serve``: its base URL, process and log file."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    model_name: str

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples without labels: ``{"kvgen:num_requests_running": 0.0, ...}``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{", 1)[0]
                labels = name_labels[len(name):]
                out[name + (labels if "finished_reason" in labels or "le=" in labels else "")] = float(value)
        return out

    def wait_metric(self, name: str, is_reached: Callable[[float], bool], timeout: float = 30.0) -> None:
        """Poll :meth:`metrics` until ``is_reached(metrics()[name])``; AssertionError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not is_reached(value := self.metrics()[name]):
            assert time.monotonic() < deadline, f"{name} is still {value} after {timeout} s"
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def start_server(model: str | Path, log_path: Path, *args: str, model_name: str = "tiny") -> LiveServer:
    """Start ``kvgen serve`` on 127.0.0.1 (free port) and wait until /health answers."""
    cmd = [sys.executable, "-m", "kvgen.cli", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
           "--served-model-name", model_name, *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + START_TIMEOUT_S
    url: str | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvgen serve exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if url is None and (match := _LISTENING.search(log_path.read_text(errors="replace"))):
            url = match.group(1)
        if url:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return LiveServer(url, proc, log_path, model_name)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"kvgen serve did not start in {START_TIMEOUT_S} s:\n{log_path.read_text(errors='replace')}")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from kvgen.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The shared tiny-model server (64 running sequences, a 2048-token context, 16-token blocks so that the short
    prompts of the tests fill blocks the prefix cache serves)."""
    live = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--num-blocks", "2048",
                        "--block-size", "16")
    yield live
    assert live.stop() == 0, live.log()[-3000:]


@pytest.fixture(scope="session")
def launch_server():
    """``start_server`` for tests that need a server of their own."""
    return start_server


@pytest.fixture
def client(server: LiveServer):
    from openai import OpenAI

    with OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
