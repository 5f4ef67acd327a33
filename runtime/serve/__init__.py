"""``hybrid serve``: an OpenAI-compatible HTTP server over the engine (app.py: routes; loop.py: the engine's thread;
protocol.py: request checks and response objects)."""
from __future__ import annotations


def serve(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the server until interrupted (uvicorn; one engine loop)."""
    import uvicorn

    from .app import build_app
    uvicorn.run(build_app(engine, model_name), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
