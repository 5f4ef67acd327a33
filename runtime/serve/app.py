"""The OpenAI-compatible HTTP app over one engine (Starlette; ``serve`` runs it with uvicorn).

    POST /v1/completions        prompt (text or token ids, one or several), streaming by server-sent events
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models, /health

Every error is a JSON error object (400 for a bad request, 404 for an unknown model or route, 500 when a step
failed), never a traceback. A client that disconnects aborts its requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.engine import Engine
from runtime.engine.sequence import TokenEvent

from . import protocol
from .loop import EngineLoop
from .protocol import APIError

log = logging.getLogger(__name__)


class Choice:
    """One prompt's output as it streams: token ids, the text decoded so far, stop strings applied. Text that could
    still turn into a stop string (or an incomplete character) is held back until it cannot."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""      # the text sent so far
        self.reason: str | None = None
        self.error: str | None = None  # what failed, when reason is "error"
        self.stopped = False  # a stop string ended it (the engine still has to be told)

    def add(self, event: TokenEvent) -> tuple[str, list[int]]:
        """The new text and token ids this event gives (the reason, when it ends the choice, is ``self.reason``)."""
        start = len(self.ids)
        if event.token_id is not None:
            self.ids.append(event.token_id)
        if self.tokenizer is None:
            if event.finished:
                self.reason = event.finish_reason
            return "", self.ids[start:]
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (full.find(s, max(0, len(self.text) - len(s) + 1)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            full, self.stopped, self.reason = full[:cut], True, "stop"
        elif event.finished:
            self.reason = event.finish_reason
        else:  # hold back what a stop string or a multi-byte character may still need
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = len(full) - hold
            while end > len(self.text) and full[end - 1] == "\ufffd":
                end -= 1
            full = full[:max(end, len(self.text))]
        piece, self.text = full[len(self.text):], full
        return piece, self.ids[start:]


def build_app(engine: Engine, model_name: str) -> Starlette:
    """The app; its lifespan starts the engine loop and stops it (aborting what is left) at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.loop = EngineLoop(engine)
        try:
            yield
        finally:
            app.state.loop.close()

    async def health(request):
        loop = request.app.state.loop
        if not loop.alive:
            return JSONResponse({"status": "error", "error": loop.error}, status_code=503)
        return JSONResponse({"status": "ok"})

    card = {"id": model_name, "object": "model", "created": CREATED, "owned_by": "hybrid",
            "max_model_len": engine.max_model_len}

    async def models(request):
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request):  # the OpenAI client's models.retrieve(name)
        if request.path_params["name"] != model_name:
            raise APIError(f"the model '{request.path_params['name']}' does not exist: this server serves "
                           f"'{model_name}'", "model", 404, kind="not_found_error", code="model_not_found")
        return JSONResponse(card)

    async def completions(request):
        return await _serve(request, chat=False)

    async def chat(request):
        return await _serve(request, chat=True)

    async def _serve(request: HTTPRequest, chat: bool):
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its request arrived whole: nothing was asked, nobody to answer
            return Response(status_code=400)
        body = protocol.parse_json(raw)
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(f"the model '{model}' does not exist: this server serves '{model_name}'", "model", 404,
                           code="model_not_found")
        if chat:
            req = protocol.chat_request(body, engine.tokenizer, engine.max_model_len)
        else:
            req = protocol.completion_request(body, engine.tokenizer)
        loop: EngineLoop = request.app.state.loop
        try:
            ids, box = await loop.submit(req.prompts, [req.params] * len(req.prompts))
        except (ValueError, TypeError) as e:
            message = " ".join(str(e).split())
            raise APIError(message, _param(message, chat)) from None
        choices = {rid: Choice(engine.tokenizer, req.stop) for rid in ids}
        def use():
            return protocol.usage(sum(map(len, req.prompts)), sum(len(c.ids) for c in choices.values()))
        rid_text = protocol.new_id(chat)
        if req.stream:
            return StreamingResponse(_stream(loop, ids, box, choices, req, rid_text, use),
                                     media_type="text/event-stream")
        await _collect(request, loop, ids, box, choices)
        failed = next((c for c in choices.values() if c.reason == "error"), None)
        if failed is not None:
            raise APIError(f"the request failed in the engine: {failed.error}", status=500, kind="server_error")
        out = protocol.completion(rid_text, model_name, [(choices[r].text, choices[r].reason) for r in ids], use(),
                                  chat)
        for item, rid in zip(out["choices"], ids):
            item["token_ids"] = choices[rid].ids  # as vLLM's return_token_ids: the engine's tokens
        return JSONResponse(out)

    async def _collect(request, loop, ids, box, choices) -> None:
        """Wait for every request of a non-streaming call; a client that disconnects aborts them."""
        gone = asyncio.ensure_future(_disconnected(request))
        open_ = set(ids)
        try:
            while open_:
                get = asyncio.ensure_future(box.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return
                _take(loop, choices, get.result(), open_)
        finally:
            gone.cancel()
            for rid in open_:
                loop.abort(rid)

    async def _stream(loop, ids, box, choices, req, rid_text, use):
        open_ = set(ids)
        index = {rid: i for i, rid in enumerate(ids)}
        try:
            if req.chat:
                for i in range(len(ids)):
                    yield _sse(protocol.chunk(rid_text, model_name, i, None, None, True, role=True))
            while open_:
                event = await box.get()
                rid = event.request_id
                taken = _take(loop, choices, event, open_)
                if taken is None:
                    continue
                piece, new_ids = taken
                reason = choices[rid].reason
                if reason == "error":
                    yield _sse(APIError(f"the request failed in the engine: {choices[rid].error}", status=500,
                                        kind="server_error").body())
                    break
                if piece or new_ids or reason:
                    c = protocol.chunk(rid_text, model_name, index[rid], piece if piece or not req.chat else None,
                                       reason, req.chat)
                    c["choices"][0]["token_ids"] = new_ids
                    yield _sse(c)
            else:
                if req.include_usage:
                    yield _sse(protocol.usage_chunk(rid_text, model_name, use(), req.chat))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or a choice failed): what is still running is aborted
            for rid in open_:
                loop.abort(rid)

    def _take(loop, choices, event, open_) -> tuple[str, list[int]] | None:
        """The event's new text and ids, or None for an event after its choice ended (tokens the engine made before
        it heard a stop string's abort, and the abort's own end): nothing of those reaches the client."""
        choice = choices[event.request_id]
        if choice.reason is not None:
            return None
        piece, new_ids = choice.add(event)
        if event.finished and event.finish_reason == "error":
            choice.reason, choice.error = "error", event.error
        if choice.stopped and not event.finished:
            loop.abort(event.request_id)
        if choice.reason is not None:
            open_.discard(event.request_id)
        return piece, new_ids

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                            Route("/v1/models/{name:path}", model),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat, methods=["POST"])],
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal},
                    lifespan=lifespan)
    return app


CREATED = int(time.time())


def _param(message: str, chat: bool) -> str | None:
    """The request field an engine refusal is about (its ``param``)."""
    if "stop_token_ids" in message:
        return "stop_token_ids"
    if "maximum length" in message or "vocabulary" in message:
        return "messages" if chat else "prompt"
    return None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _disconnected(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error(request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(APIError(message, status=exc.status_code, kind=kind).body(), status_code=exc.status_code)


async def _internal(request, exc: Exception):
    log.error("hybrid serve: %s %s failed", request.method, request.url.path, exc_info=exc)
    message = " ".join(f"{type(exc).__name__}: {exc}".split())
    return JSONResponse(APIError(f"internal error: {message}", status=500, kind="server_error").body(), status_code=500)
