"""``kvgen serve``: an OpenAI-compatible HTTP API and a chat page over ``AsyncLLMEngine``.

``build_app(engine, model_name)`` gives the FastAPI app; ``run_server`` serves it with uvicorn. Both are imported on
first use (PEP 562), so that ``kvgen.server.launch.ServerArgs`` (the ``kvgen serve`` flags every CLI command's parser
declares) does not import FastAPI: that was 0.36 s of every ``kvgen generate``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"ServerArgs": "kvgen.server.launch", "build_app": "kvgen.server.app", "run_server": "kvgen.server.launch"}

__all__ = ["ServerArgs", "build_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvgen.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
