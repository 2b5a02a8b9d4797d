"""``kvgen serve``: an OpenAI-compatible HTTP API and a chat page over ``AsyncLLMEngine``.

``build_app(engine, model_name)`` gives the FastAPI app; ``run_server`` serves it with uvicorn.
"""

from kvgen.server.app import build_app
from kvgen.server.launch import ServerArgs, run_server

__all__ = ["ServerArgs", "build_app", "run_server"]
