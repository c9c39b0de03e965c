"""The Starlette application: one function per endpoint. The endpoints find
the :class:`ServerState` and the API key in ``request.app.state``; request
bodies are parsed by :mod:`mlx_attn.serve.request_parsing`, answers written
by :mod:`mlx_attn.serve.completion` and :mod:`mlx_attn.serve.event_stream`.

Needs Starlette (the ``serve`` extra): :func:`mlx_attn.serve.server.create_app`
imports this module only when an application is built."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from importlib.resources import files

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_attn.serve.anthropic_api import count_tokens, message_body, message_events, parse_messages_request
from mlx_attn.serve.anthropic_api import error_body as anthropic_error_body
from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.completion import Completion
from mlx_attn.serve.event_stream import SSE_HEADERS, sse_events
from mlx_attn.serve.request_parsing import decode_json_object, parse_completion_request

__all__ = ["build_app", "MAX_BODY_BYTES", "CHAT_PAGE_POLICY"]

MAX_BODY_BYTES = 1 << 20  # a request larger than this is refused (413)

# the page's own files only, scripts from this origin only: model output the
# page shows is text (textContent), and the policy blocks inline script besides
CHAT_PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
                    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CHAT_PAGE_POLICY, "X-Content-Type-Options": "nosniff"}
_STATIC_TYPES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
                 "chat.css": "text/css; charset=utf-8"}


def build_app(state, api_key: str | None = None, embeddings=None) -> Starlette:
    """The application serving ``state`` (a :class:`ServerState`) and
    ``embeddings`` (an :class:`~mlx_attn.serve.embeddings.EmbeddingModel`, or
    None: ``/v1/embeddings`` answers 400)."""
    routes = [
        Route("/", guarded(page, auth=False), methods=["GET"]),
        Route("/static/{name}", guarded(page, auth=False), methods=["GET"]),
        Route("/health", guarded(health, auth=False), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/messages", guarded(messages, errors=anthropic_error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(messages_count_tokens, errors=anthropic_error_body),
              methods=["POST"]),
        Route("/v1/embeddings", guarded(embeddings_endpoint), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=_lifespan, exception_handlers={404: _not_found, 405: _not_found})
    app.state.serving, app.state.api_key, app.state.static = state, api_key, _static_files()
    app.state.embeddings = embeddings
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    await app.state.serving.start()
    try:
        yield
    finally:
        await app.state.serving.stop()


# ---------------------------------------------------------------- around every endpoint
def error_response(error: APIError, errors=APIError.body) -> JSONResponse:
    return JSONResponse(errors(error), status_code=error.status)


def guarded(handler, auth: bool = True, errors=APIError.body):
    """``handler`` behind the API key (when ``auth``), its APIErrors answered
    as JSON (``errors``: the API's error body, OpenAI's by default)."""
    async def endpoint(request: Request):
        try:
            if auth:
                authorize(request)
            return await handler(request)
        except APIError as error:
            return error_response(error, errors)
    return endpoint


def authorize(request: Request) -> None:
    """The key as ``Authorization: Bearer <key>`` or (Anthropic's) ``x-api-key: <key>``."""
    api_key = request.app.state.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    offered = [token.strip()] if scheme.lower() == "bearer" else []
    offered += [request.headers["x-api-key"].strip()] if "x-api-key" in request.headers else []
    if not any(hmac.compare_digest(key.encode(), api_key.encode()) for key in offered):
        raise APIError(401, "a valid API key is required (Authorization: Bearer <key> or x-api-key: <key>)",
                       None, "invalid_api_key")


async def _not_found(request: Request, exc):
    status = getattr(exc, "status_code", 404)
    return error_response(APIError(status, f"{request.method} {request.url.path}: "
                                           f"{getattr(exc, 'detail', 'not found')}"))


async def read_json(request: Request) -> dict:
    """The body as a JSON object, refused (413) past ``MAX_BODY_BYTES``
    before it is all read."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    return decode_json_object(raw)


# ---------------------------------------------------------------- small endpoints
async def health(request: Request):
    return JSONResponse({"status": "ok"})


async def models(request: Request):
    state = request.app.state.serving
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "mlx_attn"}]})


async def metrics(request: Request):
    state = request.app.state.serving
    text = await state.call(state.metrics)  # on the engine's thread: counts from between two steps
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def page(request: Request):
    static = request.app.state.static
    name = request.path_params.get("name", "index.html")
    if name not in static:  # only the page's own files: nothing named by a request is read
        raise APIError(404, f"no such file: {name}")
    content, media_type = static[name]
    return Response(content, media_type=media_type, headers=_PAGE_HEADERS)


def _static_files() -> dict[str, tuple[bytes, str]]:
    folder = files("mlx_attn.serve").joinpath("static")
    return {name: (folder.joinpath(name).read_bytes(), media) for name, media in _STATIC_TYPES.items()}


# ---------------------------------------------------------------- completions
async def chat_completions(request: Request):
    return await _complete(request, chat=True)


async def completions(request: Request):
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool):
    state = request.app.state.serving
    parsed = parse_completion_request(state, await read_json(request), chat)
    state.check_room(parsed.n)
    return await _answer(request, Completion(state, parsed, chat), parsed.stream, sse_events, Completion.whole_body)


async def _answer(request: Request, completion: Completion, stream: bool, events, whole_body):
    """Start ``completion``; stream ``events(completion)`` or wait for the
    whole answer, ``whole_body(completion)`` (499 if the client left)."""
    await completion.start()
    if stream:
        return StreamingResponse(events(completion), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        done = await wait_or_disconnect(request, completion.collect())
    finally:
        completion.cancel_all()
    if done is None:
        return PlainTextResponse("", status_code=499)
    return JSONResponse(whole_body(completion))


# ---------------------------------------------------------------- the Anthropic Messages API
async def messages(request: Request):
    state = request.app.state.serving
    parsed = parse_messages_request(state, await read_json(request))
    state.check_room(1)
    return await _answer(request, Completion(state, parsed, chat=True), parsed.stream, message_events, message_body)


async def messages_count_tokens(request: Request):
    return JSONResponse(count_tokens(request.app.state.serving, await read_json(request)))


# ---------------------------------------------------------------- embeddings
async def embeddings_endpoint(request: Request):
    body = await read_json(request)
    embeddings = request.app.state.embeddings
    if embeddings is None:
        raise APIError(400, "this server has no embedding model (start it with --embedding-model)", "model")
    return JSONResponse(await embeddings.answer(request.app.state.serving, body))


async def wait_or_disconnect(request: Request, work):
    """Run ``work`` unless the client disconnects first (then it is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return task.result() if not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
