"""``hybrid serve``: an OpenAI-compatible HTTP server over the engine (app.py: routes; loop.py: the engine's thread;
protocol.py: request checks and response objects)."""
from __future__ import annotations


def serve(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          announce=None) -> None:
    """Run the server until interrupted (uvicorn; one engine loop). The socket is bound here, so ``announce`` (called
    with the port before serving) gets the port the system chose for ``port=0``."""
    import socket

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    bound = sock.getsockname()[1]
    if announce is not None:
        announce(bound)
    server(engine, model_name, host=host, port=bound, log_level=log_level, timeout_graceful_shutdown=5).run(
        sockets=[sock])


def server(engine, model_name: str, **config):
    """A uvicorn server of the app (``config``: uvicorn.Config's arguments). At shutdown it ends the requests under
    way first (finish reason "abort"), so every open stream gets its last chunk and ``[DONE]`` before the
    connections close, rather than waiting out the graceful timeout and being cut."""
    import uvicorn

    from .app import build_app
    app = build_app(engine, model_name)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            loop = getattr(app.state, "loop", None)
            if loop is not None:
                loop.end_requests()
            await super().shutdown(sockets=sockets)

    return Server(uvicorn.Config(app, **config))
