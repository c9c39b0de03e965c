"""A completion request in flight: its ``n`` choices submitted to the engine
(through a :class:`ServerState`), and the OpenAI bodies of its answer, whole
or as chunks (:mod:`mlx_attn.serve.event_stream` sends those)."""

from __future__ import annotations

import asyncio
import time
import uuid

from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.choice_stream import Choice, LogprobFormatter, TextStream
from mlx_attn.serve.request_parsing import CompletionRequest
from mlx_attn.serve.tool_calls import ToolUse, call_stream, tool_call_format

__all__ = ["Completion"]


class Completion:
    """One chat (``chat``) or plain completion request and its choices."""

    def __init__(self, state, request: CompletionRequest, chat: bool):
        self.state, self.request, self.chat = state, request, chat
        self.kind = "chat.completion" if chat else "text_completion"
        self.choices: list[Choice] = []
        self.id = ""
        self.created = 0

    # ------------------------------------------------------------ the engine requests
    async def start(self) -> None:
        """Submit choice 0 (the others follow in :meth:`submit_others`)."""
        await self.submit(0)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def submit(self, index: int) -> Choice:
        state, request = self.state, self.request
        try:
            constraint = request.constraint() if request.constraint is not None else None
            rid, queue = await state.submit(request.prompt, request.max_tokens, request.sampling[index],
                                            constraint=constraint, speculative=request.drafts)
        except ValueError as error:  # can never fit the pool, or the model's own checks
            raise APIError(400, str(error), "max_tokens") from None
        logprobs = LogprobFormatter(state.tokenizer, self.chat) if request.logprobs else None
        tool_use = request.tool_use
        calls = None
        fmt = tool_call_format(state.tokenizer) if self.chat or tool_use is not None else None
        if tool_use is not None and tool_use.choice != "none":
            calls = call_stream(fmt, tool_use)
        elif fmt is not None and fmt.name == "harmony":  # gpt-oss: its messages read, the reasoning left out
            calls = call_stream(fmt, tool_use or ToolUse((), "none"))
        choice = Choice(index, rid, queue, TextStream(state.tokenizer, request.stops), logprobs, calls)
        self.choices.append(choice)
        return choice

    async def submit_others(self) -> list[Choice]:
        # once choice 0's prompt is in the pages, the others find it in the prefix cache
        if self.request.n > 1:
            await self.state.first_output(self.choices[0].rid)
        return [await self.submit(i) for i in range(1, self.request.n)]

    def cancel_all(self) -> None:
        """A no-op for requests that ended; frees the pages of the others."""
        for choice in self.choices:
            self.state.cancel(choice.rid)

    # ------------------------------------------------------------ the whole answer
    async def collect(self) -> bool:
        """Every choice's whole text (``Choice.content``)."""
        tasks = [asyncio.ensure_future(self._collect(self.choices[0]))]
        try:
            tasks += [asyncio.ensure_future(self._collect(c)) for c in await self.submit_others()]
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return True

    async def _collect(self, choice: Choice) -> None:
        choice.content = "".join([text async for text, _ in choice.pieces(self.state)])

    def whole_body(self) -> dict:
        choices = sorted(self.choices, key=lambda c: c.index)
        return self.envelope([self.choice_body(c, c.content, c.finish_reason, False, c.calls) for c in choices],
                             self.usage())

    # ------------------------------------------------------------ bodies
    def choice_body(self, choice: Choice, piece: str | None, finish: str | None, delta: bool,
                    calls: list = ()) -> dict:
        """``calls``: tool calls made by this piece (delta) or the whole answer."""
        logprobs = choice.take_logprobs()
        if not self.chat:
            return {"index": choice.index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        if delta:
            change = {"content": piece} if piece else {}
            if calls:
                change["tool_calls"] = [call.openai(delta=True) for call in calls]
            return {"index": choice.index, "delta": change, "logprobs": logprobs, "finish_reason": finish}
        message = {"role": "assistant", "content": piece if piece or not calls else None}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def role_chunk(self, choice: Choice) -> dict:
        """A chat stream's first chunk of a choice: the assistant's role."""
        return self.envelope([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}], chunk=True)

    def envelope(self, choices: list, usage: dict | None = None, chunk: bool = False) -> dict:
        out = {"id": self.id, "object": self.kind + (".chunk" if chunk and self.chat else ""),
               "created": self.created, "model": self.state.model_name, "choices": choices}
        if usage is not None or not chunk:
            out["usage"] = usage
        return out

    def usage(self) -> dict:
        prompt = len(self.request.prompt)
        completion = sum(c.text.tokens for c in self.choices)
        cached = self.choices[0].text.cached_tokens if self.choices else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
