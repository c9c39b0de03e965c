"""A completion streamed as server-sent events: ``data: {chunk}`` lines as
each choice's text comes, a last chunk per choice with its finish reason, a
usage chunk when asked, then ``data: [DONE]`` (an error event if the model
fails)."""

from __future__ import annotations

import asyncio
import contextlib
import json

from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.choice_stream import Choice
from mlx_attn.serve.completion import Completion

__all__ = ["sse_events", "SSE_HEADERS"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse_events(completion: Completion):
    """The events of ``completion`` (choice 0 already submitted); the
    choices' engine requests are cancelled when the stream ends or is
    abandoned."""
    merged: asyncio.Queue = asyncio.Queue()  # (choice, text piece | None at its end | APIError)
    pumps = [asyncio.ensure_future(_pump(completion, completion.choices[0], merged))]
    try:
        if completion.chat:
            yield sse(completion.role_chunk(completion.choices[0]))
        others = await completion.submit_others()
        pumps += [asyncio.ensure_future(_pump(completion, c, merged)) for c in others]
        for choice in others:
            if completion.chat:
                yield sse(completion.role_chunk(choice))
        async with contextlib.aclosing(_chunks(completion, merged)) as chunks:
            async for chunk in chunks:
                yield sse(chunk)
        yield "data: [DONE]\n\n"
    except APIError as error:
        yield sse(error.body())
    finally:
        for task in pumps:
            task.cancel()
        completion.cancel_all()


async def _pump(completion: Completion, choice: Choice, merged: asyncio.Queue) -> None:
    try:
        async for piece in choice.pieces(completion.state):  # (text, tool calls)
            merged.put_nowait((choice, piece))
        merged.put_nowait((choice, None))
    except APIError as error:
        merged.put_nowait((choice, error))


async def _chunks(completion: Completion, merged: asyncio.Queue):
    """Chunks in the order the choices' pieces arrive, until every choice
    ended; then the usage chunk if ``stream_options.include_usage``."""
    running = len(completion.choices)
    while running:
        choice, piece = await merged.get()
        if isinstance(piece, APIError):
            raise piece
        if piece is None:
            running -= 1
            yield completion.envelope([completion.choice_body(choice, None, choice.finish_reason, True)],
                                      chunk=True)
        else:
            text, calls = piece
            yield completion.envelope([completion.choice_body(choice, text, None, True, calls)], chunk=True)
    if completion.request.include_usage:
        yield completion.envelope([], completion.usage(), chunk=True)
