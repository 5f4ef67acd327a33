"""``hybrid serve``: an OpenAI-compatible HTTP server over the engine (app.py: routes; loop.py: the engine's thread;
protocol.py: request checks and response objects)."""
from __future__ import annotations


def serve(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          announce=None) -> None:
    """Run the server until interrupted (uvicorn; one engine loop). The socket is bound here, so ``announce`` (called
    with the port before serving) gets the port the system chose for ``port=0``."""
    import socket

    import uvicorn

    from .app import build_app
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    bound = sock.getsockname()[1]
    if announce is not None:
        announce(bound)
    config = uvicorn.Config(build_app(engine, model_name), host=host, port=bound, log_level=log_level,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
