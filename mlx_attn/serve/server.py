"""An OpenAI-compatible HTTP server over the engine (Starlette on uvicorn).

    mlx-attn serve --model model.gguf --host 127.0.0.1 --port 8080

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text).

One background task steps the engine while requests are active. Every engine
call (submit, step, cancel) runs on one worker thread, so the engine is never
touched from two threads; generated tokens go to per-request asyncio queues.
A client that disconnects cancels its request (its pages are freed before the
next step).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hmac
import itertools
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Hashable

__all__ = ["ServerState", "create_app", "make_state", "build_parser", "exposure_warning", "main"]

API_KEY_ENV = "MLX_ATTN_API_KEY"
MAX_BODY_BYTES = 1 << 20  # a request larger than this is refused (413)
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 16  # n: choices of one request, each an engine request
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- the engine loop
class _Active:
    """A request the server is serving: its queue of engine outputs."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue
        self.started = asyncio.Event()  # its first output (or an error) arrived: its prompt's pages are computed


class ServerState:
    """The engine, the worker thread that alone calls it, and the stepping task."""

    def __init__(self, make_engine, tokenizer, model_name: str, *, default_max_tokens: int = 512,
                 default_temperature: float = 0.0, max_requests: int = 256):
        """``make_engine()`` builds the engine on its own thread: MLX streams
        are per thread, so its arrays are made where they are used."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.default_temperature = default_temperature
        self.max_requests = max_requests  # being served at once (running or waiting); more get 429
        self.created = int(time.time())
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-attn-engine")
        self.engine = self.call_blocking(make_engine)
        self._active: dict[Hashable, _Active] = {}
        self._cancels: list[Hashable] = []
        self._cancels_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.generated_tokens = 0
        self.requests_total = 0
        self.cancelled_requests = 0  # cancelled in the engine before they ended (disconnects, stop strings)
        self.started = time.monotonic()

    @property
    def context(self) -> int | None:
        return getattr(self.engine.model.config, "max_position_embeddings", None)

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        from mlx_attn import _ext

        # Empty the engine thread's compile cache while Python can still free
        # its entries (freed at the thread's exit, they abort a process that
        # is already shutting down).
        await self.call(_ext.forget_thread_compile_cache)
        self._executor.shutdown(wait=True)

    def call_blocking(self, fn, *args, timeout: float = 60.0):
        """Run ``fn`` on the engine's thread from another thread (tests, tools)."""
        return self._executor.submit(fn, *args).result(timeout)

    async def call(self, fn, *args):
        """Run ``fn`` on the engine's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def check_room(self, count: int) -> None:
        """429 unless ``count`` more requests fit under ``max_requests``."""
        if len(self._active) + count > self.max_requests:
            raise APIError(429, f"the server is serving its limit of {self.max_requests} requests; retry later",
                           None, "rate_limit_exceeded")

    async def submit(self, prompt: list[int], max_tokens: int, sampling) -> tuple[Hashable, asyncio.Queue]:
        self.check_room(1)
        rid = f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()

        def submit():
            self.engine.submit(rid, prompt, max_tokens, stop_token_ids=sorted(self.tokenizer.eos_token_ids),
                               sampling=sampling)

        self._active[rid] = _Active(queue)  # counts against the limit from now on
        try:
            await self.call(submit)
        except BaseException:
            self._active.pop(rid, None)
            raise
        self.requests_total += 1
        self._wake.set()
        return rid, queue

    async def first_output(self, rid: Hashable) -> None:
        """Wait for a request's first output (its prompt is in the pages)."""
        active = self._active.get(rid)
        if active is not None:
            await active.started.wait()

    def cancel(self, rid: Hashable) -> None:
        """Cancel from anywhere (also a cancelled task's cleanup): applied on
        the engine's thread before its next step."""
        if self._active.pop(rid, None) is None:
            return
        with self._cancels_lock:
            self._cancels.append(rid)
        if self._wake is not None:
            self._wake.set()

    def finished(self, rid: Hashable) -> None:
        self._active.pop(rid, None)

    def _step(self):
        with self._cancels_lock:
            cancels, self._cancels = self._cancels, []
        for rid in cancels:
            self.cancelled_requests += self.engine.cancel(rid)
        if self.engine.idle:
            return [], False
        return self.engine.step(), not self.engine.idle

    @property
    def idle(self) -> bool:
        """No request is being served and the engine has nothing left."""
        return not self._active and not self._cancels and self.engine.idle

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            busy = True
            while busy:
                try:
                    outputs, busy = await self.call(self._step)
                except Exception as error:  # noqa: BLE001  the model failed: fail its requests, keep serving
                    for rid in list(self._active):
                        self._active[rid].queue.put_nowait(error)
                        self._active[rid].started.set()
                        self.cancel(rid)
                    break
                for output in outputs:
                    self.generated_tokens += 1
                    active = self._active.get(output.request_id)
                    if active is not None:
                        active.queue.put_nowait(output)
                        active.started.set()
                if self._cancels:
                    busy = True

    def metrics(self) -> str:
        stats = self.engine.stats()
        elapsed = max(time.monotonic() - self.started, 1e-9)
        lines = []

        def metric(name, kind, help_text, value):
            lines.extend([f"# HELP mlx_attn_{name} {help_text}", f"# TYPE mlx_attn_{name} {kind}",
                          f"mlx_attn_{name} {value}"])

        metric("requests_running", "gauge", "Requests with pages in the pool.", stats["running"])
        metric("requests_waiting", "gauge", "Requests waiting for admission.", stats["waiting"])
        metric("requests_total", "counter", "Requests accepted.", self.requests_total)
        metric("pages_total", "gauge", "Pages in the pool.", stats["pages_total"])
        metric("pages_used", "gauge", "Pages held by requests.", stats["pages_held"])
        metric("pages_cached", "gauge", "Pages held by no request, kept for the prefix cache.",
               stats["pages_cached"])
        metric("pages_free", "gauge", "Free pages.", stats["pages_free"])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / prompt tokens.",
               stats["prefix_hit_rate"])
        metric("requests_cancelled_total", "counter", "Requests cancelled before they ended.",
               self.cancelled_requests)
        metric("preemptions_total", "counter", "Requests preempted for pages.", stats["preemptions"])
        metric("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens)
        metric("generated_tokens_per_second", "gauge", "Tokens generated per second since start.",
               self.generated_tokens / elapsed)
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- request parsing
def _field(body: dict, name: str, kinds, default=None, check=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise APIError(400, f"{name} must be {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise APIError(400, f"{name} must be {_kind_names(kinds)}, got {type(value).__name__}", name)
    if check is not None and not check(value):
        raise APIError(400, f"{name} is out of range: {value!r}", name)
    return value


def _kind_names(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop holds at most {MAX_STOP_STRINGS} strings", "stop")
    return stops


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"messages[{index}].content must be a string or a list of text parts", "messages")


class _Request:
    """What both completion endpoints need from a request body."""

    def __init__(self, state: ServerState, body: dict, chat: bool):
        from mlx_attn.serve.sampling import SamplingParams

        model = _field(body, "model", str, state.model_name)
        if model != state.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")
        self.n = _field(body, "n", int, 1, lambda n: 1 <= n <= MAX_CHOICES)
        if chat:  # logprobs: true|false, top_logprobs: 0..20 (needs logprobs)
            self.logprobs = _field(body, "logprobs", bool, False)
            top = _field(body, "top_logprobs", int, None, lambda k: 0 <= k <= MAX_TOP_LOGPROBS)
            if top is not None and not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            top = top or 0
        else:  # logprobs: null or 0..20, the number of most likely tokens listed at each position
            top = _field(body, "logprobs", int, None, lambda k: 0 <= k <= MAX_TOP_LOGPROBS)
            self.logprobs = top is not None
            top = top or 0
        self.top_logprobs = top
        self.stream = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, {})
        self.include_usage = bool(options.get("include_usage", False))
        self.stops = _stop_strings(body)
        self.prompt = self._chat_prompt(state, body) if chat else self._completion_prompt(state, body)
        context = state.context
        if not self.prompt:
            raise APIError(400, "the prompt is empty", "messages" if chat else "prompt")
        if context is not None and len(self.prompt) >= context:
            raise APIError(400, f"the prompt has {len(self.prompt)} tokens; this model's context is {context}",
                           "messages" if chat else "prompt", "context_length_exceeded")
        room = context - len(self.prompt) if context is not None else state.default_max_tokens
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        requested = _field(body, name, int, None)
        if requested is None:
            requested = min(state.default_max_tokens, room)
        if requested < 1:
            raise APIError(400, f"{name} must be at least 1, got {requested}", name)
        if context is not None and requested > room:
            raise APIError(400, f"{name} ({requested}) + the prompt ({len(self.prompt)} tokens) exceed this "
                                f"model's context of {context}", name, "context_length_exceeded")
        self.max_tokens = requested
        temperature = _field(body, "temperature", (int, float), state.default_temperature, lambda t: 0 <= t <= 2)
        top_p = _field(body, "top_p", (int, float), 1.0, lambda p: 0 < p <= 1)
        top_k = _field(body, "top_k", int, 0, lambda k: k >= 0)
        min_p = _field(body, "min_p", (int, float), 0.0, lambda p: 0 <= p <= 1)
        penalty = _field(body, "repetition_penalty", (int, float), 1.0, lambda p: p > 0)
        seed = _field(body, "seed", int, None, lambda s: 0 <= s < 2**63)
        try:
            # choice i of n draws with seed + i: a seeded request is reproducible, its choices differ
            self.sampling = [SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                                            min_p=float(min_p), repetition_penalty=float(penalty),
                                            seed=None if seed is None else (seed + i) % 2**63,
                                            logprobs=self.logprobs, top_logprobs=self.top_logprobs)
                             for i in range(self.n)]
        except ValueError as error:
            raise APIError(400, str(error)) from None

    @staticmethod
    def _chat_prompt(state: ServerState, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        rendered = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a string role", "messages")
            rendered.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
        try:
            text = state.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
            return state.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None

    @staticmethod
    def _completion_prompt(state: ServerState, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                return state.tokenizer.encode(prompt)
            except ValueError as error:
                raise APIError(400, str(error), "prompt") from None
        vocab = state.engine.model.config.vocab_size
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                            for t in prompt):
            return list(prompt)
        raise APIError(400, f"prompt must be a string or a list of token ids in [0, {vocab})", "prompt")


# ---------------------------------------------------------------- generation
class _TextStream:
    """Engine outputs of one choice -> text pieces, honouring stop strings
    (text that could still become a stop string is held back); keeps the
    outputs' log-probabilities until they are sent."""

    def __init__(self, tokenizer, stops: list[str]):
        from mlx_attn.lm.tokenizer import StreamingDetokenizer

        self.detokenizer = StreamingDetokenizer(tokenizer)
        self.eos = tokenizer.eos_token_ids
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buffer = ""
        self.tokens = 0
        self.cached_tokens = 0  # prompt tokens found in the prefix cache
        self.finish_reason: str | None = None
        self.logprobs: list = []  # (token, logprob, top) of outputs not yet sent

    def add(self, output) -> str:
        """The text now safe to send; sets ``finish_reason`` when done."""
        self.tokens += 1
        self.cached_tokens = output.cached_tokens
        self.logprobs.append((output.token, output.logprob, output.top_logprobs))
        if output.token in self.eos:
            self.finish_reason = "stop"
            return self._flush()
        self.buffer += self.detokenizer.add(output.token)
        if output.finished:
            self.buffer += self.detokenizer.finish()
            self.finish_reason = "length"
        for stop in self.stops:
            at = self.buffer.find(stop)
            if at >= 0:
                self.buffer = self.buffer[:at]
                self.finish_reason = "stop"
        if self.finish_reason:
            return self._flush()
        cut = len(self.buffer) - self.hold
        if cut <= 0:
            return ""
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return text

    def _flush(self) -> str:
        text, self.buffer = self.buffer, ""
        return text

    def take_logprobs(self) -> list:
        taken, self.logprobs = self.logprobs, []
        return taken


async def _outputs(state: ServerState, rid: Hashable, queue: asyncio.Queue, text: _TextStream):
    """Text pieces of a request until it ends; cancels it in the engine when
    the consumer goes away early (disconnect) or stops on a stop string."""
    ended = False
    try:
        while text.finish_reason is None:
            output = await queue.get()
            if isinstance(output, Exception):
                raise APIError(500, f"the model failed: {type(output).__name__}: {output}")
            ended = output.finished
            piece = text.add(output)
            if piece:
                yield piece
            if ended:
                break
    finally:
        if ended:
            state.finished(rid)
        else:
            state.cancel(rid)  # disconnect, error or stop string: free its pages now


class _Logprobs:
    """Log-probabilities in OpenAI's two formats (chat: ``content`` entries;
    completions: parallel lists), token text decoded one token at a time."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions' text_offset: characters of the choice's tokens so far

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def format(self, entries: list) -> dict:
        if self.chat:
            def item(token, logprob):
                text = self._text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**item(token, logprob), "top_logprobs": [item(t, lp) for t, lp in top]}
                                for token, logprob, top in entries], "refusal": None}
        tokens = [self._text(token) for token, _, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in entries],
                "top_logprobs": [{self._text(t): lp for t, lp in top} for _, _, top in entries],
                "text_offset": offsets}


class _Choice:
    """One of a request's ``n`` choices: its engine request and its text."""

    def __init__(self, index: int, rid: Hashable, queue: asyncio.Queue, text: _TextStream, logprobs):
        self.index, self.rid, self.queue, self.text, self.logprobs = index, rid, queue, text, logprobs
        self.content = ""

    def take_logprobs(self) -> dict | None:
        return self.logprobs.format(self.text.take_logprobs()) if self.logprobs else None


def _usage(request: _Request, choices: list[_Choice]) -> dict:
    completion = sum(c.text.tokens for c in choices)
    return {"prompt_tokens": len(request.prompt), "completion_tokens": completion,
            "total_tokens": len(request.prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": choices[0].text.cached_tokens if choices else 0}}



def create_app(state: ServerState, *, api_key: str | None = None):
    """The Starlette application serving ``state``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error_response(error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)", None,
                           "invalid_api_key")

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def guarded(handler, auth=True):
        async def endpoint(request: Request):
            try:
                if auth:
                    authorize(request)
                return await handler(request)
            except APIError as error:
                return error_response(error)
        return endpoint

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "mlx_attn"}]})

    async def metrics(request: Request):
        text = await state.call(state.metrics)  # on the engine's thread: counts from between two steps
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def wait_or_disconnect(request: Request, work):
        """Run ``work`` unless the client disconnects first (then it is cancelled)."""
        task = asyncio.ensure_future(work)

        async def disconnected():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task.result() if not task.cancelled() else None

    def completion_endpoint(chat: bool):
        kind = "chat.completion" if chat else "text_completion"

        async def handler(request: Request):
            body = await read_json(request)
            parsed = _Request(state, body, chat)
            state.check_room(parsed.n)
            choices: list[_Choice] = []

            async def submit(index: int) -> _Choice:
                try:
                    rid, queue = await state.submit(parsed.prompt, parsed.max_tokens, parsed.sampling[index])
                except ValueError as error:  # can never fit the pool, or the model's own checks
                    raise APIError(400, str(error), "max_tokens") from None
                logprobs = _Logprobs(state.tokenizer, chat) if parsed.logprobs else None
                choice = _Choice(index, rid, queue, _TextStream(state.tokenizer, parsed.stops), logprobs)
                choices.append(choice)
                return choice

            async def submit_others() -> list[_Choice]:
                # once choice 0's prompt is in the pages, the others find it in the prefix cache
                if parsed.n > 1:
                    await state.first_output(choices[0].rid)
                return [await submit(i) for i in range(1, parsed.n)]

            def cancel_all():  # no-op for requests that ended; frees the pages of the others
                for c in choices:
                    state.cancel(c.rid)

            await submit(0)
            response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            created = int(time.time())

            def choice_body(c: _Choice, piece: str | None, finish: str | None, delta: bool) -> dict:
                logprobs = c.take_logprobs()
                if not chat:
                    return {"index": c.index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
                if delta:
                    return {"index": c.index, "delta": {"content": piece} if piece else {}, "logprobs": logprobs,
                            "finish_reason": finish}
                return {"index": c.index, "message": {"role": "assistant", "content": piece}, "logprobs": logprobs,
                        "finish_reason": finish}

            def envelope(choice_list: list, usage: dict | None = None, chunk: bool = False) -> dict:
                out = {"id": response_id, "object": kind + (".chunk" if chunk and chat else ""), "created": created,
                       "model": state.model_name, "choices": choice_list}
                if usage is not None or not chunk:
                    out["usage"] = usage
                return out

            if not parsed.stream:
                async def collect(c: _Choice):
                    c.content = "".join([piece async for piece in _outputs(state, c.rid, c.queue, c.text)])

                async def collect_all():
                    tasks = [asyncio.ensure_future(collect(choices[0]))]
                    try:
                        tasks += [asyncio.ensure_future(collect(c)) for c in await submit_others()]
                        await asyncio.gather(*tasks)
                    finally:
                        for task in tasks:
                            task.cancel()
                    return True

                try:
                    done = await wait_or_disconnect(request, collect_all())
                finally:
                    cancel_all()
                if done is None:
                    return PlainTextResponse("", status_code=499)
                return JSONResponse(envelope([choice_body(c, c.content, c.text.finish_reason, False)
                                              for c in sorted(choices, key=lambda c: c.index)],
                                             _usage(parsed, choices)))

            def sse(payload) -> str:
                return f"data: {json.dumps(payload)}\n\n"

            async def events():
                merged: asyncio.Queue = asyncio.Queue()

                async def pump(c: _Choice):
                    try:
                        async for piece in _outputs(state, c.rid, c.queue, c.text):
                            merged.put_nowait((c, piece))
                        merged.put_nowait((c, None))
                    except APIError as error:
                        merged.put_nowait((c, error))

                pumps = [asyncio.ensure_future(pump(choices[0]))]
                try:
                    if chat:
                        yield sse(envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], chunk=True))
                    others = await submit_others()
                    pumps += [asyncio.ensure_future(pump(c)) for c in others]
                    for c in others:
                        if chat:
                            yield sse(envelope([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], chunk=True))
                    running = len(choices)
                    while running:
                        c, piece = await merged.get()
                        if isinstance(piece, APIError):
                            raise piece
                        if piece is None:
                            running -= 1
                            yield sse(envelope([choice_body(c, None, c.text.finish_reason, True)], chunk=True))
                        else:
                            yield sse(envelope([choice_body(c, piece, None, True)], chunk=True))
                    if parsed.include_usage:
                        yield sse(envelope([], _usage(parsed, choices), chunk=True))
                    yield "data: [DONE]\n\n"
                except APIError as error:
                    yield sse(error.body())
                finally:
                    for task in pumps:
                        task.cancel()
                    cancel_all()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        return handler

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    page_headers = {"Content-Security-Policy": CHAT_PAGE_POLICY, "X-Content-Type-Options": "nosniff"}
    static = _static_files()

    async def page(request: Request):
        name = request.path_params.get("name", "index.html")
        if name not in static:  # only the page's own files: nothing named by a request is read
            raise APIError(404, f"no such file: {name}")
        content, media_type = static[name]
        return Response(content, media_type=media_type, headers=page_headers)

    routes = [
        Route("/", guarded(page, auth=False), methods=["GET"]),
        Route("/static/{name}", guarded(page, auth=False), methods=["GET"]),
        Route("/health", guarded(health, auth=False), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/v1/chat/completions", guarded(completion_endpoint(True)), methods=["POST"]),
        Route("/v1/completions", guarded(completion_endpoint(False)), methods=["POST"]),
    ]

    async def not_found(request, exc):
        status = getattr(exc, "status_code", 404)
        return error_response(APIError(status, f"{request.method} {request.url.path}: "
                                               f"{getattr(exc, 'detail', 'not found')}"))

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})


# ---------------------------------------------------------------- the chat page
# the page's own files only, scripts from this origin only: model output the
# page shows is text (textContent), and the policy blocks inline script besides
CHAT_PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
                    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_STATIC_TYPES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
                 "chat.css": "text/css; charset=utf-8"}


def _static_files() -> dict[str, tuple[bytes, str]]:
    from importlib.resources import files

    folder = files("mlx_attn.serve").joinpath("static")
    return {name: (folder.joinpath(name).read_bytes(), media) for name, media in _STATIC_TYPES.items()}


# ---------------------------------------------------------------- the command
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # the mlx-attn command prints one line and exits 2
        raise ValueError(f"{self.prog}: {message}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-attn serve", description="An OpenAI-compatible server (continuous batching over "
                                                        "paged, prefix-sharing K/V).")
    parser.add_argument("--model", default=None, help="a .gguf file, a model directory or a registered name "
                                                      "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-tokens", type=_positive, default=512,
                        help="max_tokens of a request that gives none")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature of a request that gives none")
    parser.add_argument("--kv-cache-tokens", type=_positive, default=16384,
                        help="the page pool's capacity in tokens, all requests together")
    parser.add_argument("--page-size", type=_positive, default=16, help="tokens per page")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, help="quantized K/V pages")
    parser.add_argument("--max-batch-tokens", type=_positive, default=256, help="tokens per engine step")
    parser.add_argument("--max-requests", type=_positive, default=256,
                        help="requests served at once (running or waiting for pages); more are answered 429")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--weights", choices=["auto", "float32", "as-loaded"], default="auto",
                        help="how the engine holds the weights: auto is float32 on MLX's CPU device (batched BLAS "
                             "matmuls), as loaded on a GPU (quantized matmuls)")
    parser.add_argument("--backend", choices=["auto", "fused", "reference"], default="auto")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def make_state(model, tokenizer, model_name: str, *, kv_cache_tokens: int = 16384, page_size: int = 16,
               kv_bits: int | None = None, max_batch_tokens: int = 256, max_tokens: int = 512,
               temperature: float = 0.0, max_requests: int = 256, weights: str = "auto") -> ServerState:
    from mlx_attn.serve.engine import Engine

    import mlx.core as mx

    mx.eval(model.parameters())  # loaded here, used on the engine's thread

    def make_engine():
        return Engine(model, kv_tokens=kv_cache_tokens, page_size=page_size, kv_bits=kv_bits,
                      max_batch_tokens=max_batch_tokens, weights=weights)

    return ServerState(make_engine, tokenizer, model_name, default_max_tokens=max_tokens,
                       default_temperature=temperature, max_requests=max_requests)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to print when others than this machine may use the server freely."""
    if host in LOOPBACK or api_key:
        return None
    return (f"mlx-attn serve: warning: listening on {host} without an API key: anyone who can reach this "
            f"address may use the model (set --api-key or ${API_KEY_ENV})")


def main(argv: list[str] | None = None) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as error:
        raise RuntimeError(f"mlx-attn serve needs Starlette and uvicorn ({error}): "
                           "pip install 'mlx_attn[serve]'") from None

    from mlx_attn.lm.loading import load_model
    from mlx_attn.lm.model_store import DEFAULT_DECODER

    args = build_parser().parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    model, tokenizer = load_model(args.model, backend=args.backend)
    state = make_state(model, tokenizer, args.model or DEFAULT_DECODER, kv_cache_tokens=args.kv_cache_tokens,
                       page_size=args.page_size, kv_bits=args.kv_bits, max_batch_tokens=args.max_batch_tokens,
                       max_tokens=args.max_tokens, temperature=args.temp, max_requests=args.max_requests,
                       weights=args.weights)
    app = create_app(state, api_key=api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    _graceful_server_class()(config).run()
    return 0


def _graceful_server_class():
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """On SIGTERM or SIGINT: stop accepting, let running requests finish,
        then exit 0 (uvicorn itself re-raises the signal once shut down)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer
