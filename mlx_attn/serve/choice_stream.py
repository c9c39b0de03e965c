"""One choice of a completion: its engine outputs turned into text pieces
(stop strings honoured) and log-probabilities in OpenAI's formats."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

from mlx_attn.serve.api_error import APIError

__all__ = ["TextStream", "LogprobFormatter", "Choice"]


class TextStream:
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
        self.stop_string: str | None = None  # the stop string that ended the text
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
        self._cut_at_stop_strings()
        if self.finish_reason:
            return self._flush()
        cut = len(self.buffer) - self.hold
        if cut <= 0:
            return ""
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return text

    def _cut_at_stop_strings(self) -> None:
        for stop in self.stops:
            at = self.buffer.find(stop)
            if at >= 0:
                self.buffer = self.buffer[:at]
                self.finish_reason, self.stop_string = "stop", stop

    def _flush(self) -> str:
        text, self.buffer = self.buffer, ""
        return text

    def take_logprobs(self) -> list:
        taken, self.logprobs = self.logprobs, []
        return taken


class LogprobFormatter:
    """Log-probabilities in OpenAI's two formats (chat: ``content`` entries;
    completions: parallel lists), token text decoded one token at a time."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions' text_offset: characters of the choice's tokens so far

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def format(self, entries: list) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat_item(self, token: int, logprob: float) -> dict:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _chat(self, entries: list) -> dict:
        return {"content": [{**self._chat_item(token, logprob),
                             "top_logprobs": [self._chat_item(t, lp) for t, lp in top]}
                            for token, logprob, top in entries], "refusal": None}

    def _completion(self, entries: list) -> dict:
        tokens = [self._text(token) for token, _, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in entries],
                "top_logprobs": [{self._text(t): lp for t, lp in top} for _, _, top in entries],
                "text_offset": offsets}


class Choice:
    """One of a request's ``n`` choices: its engine request, its text and,
    when the request offers tools, the calls parsed from it (``tool_calls``,
    a :class:`~mlx_attn.serve.tool_calls.ToolCallStream`)."""

    def __init__(self, index: int, rid: Hashable, queue: asyncio.Queue, text: TextStream,
                 logprobs: LogprobFormatter | None, tool_calls=None):
        self.index, self.rid, self.queue, self.text, self.logprobs = index, rid, queue, text, logprobs
        self.tool_calls = tool_calls
        self.content = ""
        self.calls: list = []  # every ToolCall made so far

    def take_logprobs(self) -> dict | None:
        return self.logprobs.format(self.text.take_logprobs()) if self.logprobs else None

    @property
    def finish_reason(self) -> str | None:
        """The text's, except ``tool_calls`` for an answer that called tools and ended by itself."""
        reason = self.text.finish_reason
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _split(self, piece: str, last: bool) -> tuple[str, list]:
        if self.tool_calls is None:
            return piece, []
        content, calls = self.tool_calls.add(piece)
        if last:
            rest, more = self.tool_calls.finish()
            content, calls = content + rest, calls + more
        self.calls += calls
        return content, calls

    async def pieces(self, state):
        """``(text, tool calls)`` pieces until the request ends; cancels it in
        the engine (``state.cancel``) when the consumer goes away early
        (disconnect) or it stops on a stop string."""
        ended = False
        try:
            while self.text.finish_reason is None:
                output = await self.queue.get()
                if isinstance(output, Exception):
                    raise APIError(500, f"the model failed: {type(output).__name__}: {output}")
                ended = output.finished
                text, calls = self._split(self.text.add(output), self.text.finish_reason is not None)
                if text or calls:
                    yield text, calls
                if ended:
                    break
        finally:
            if ended:
                state.finished(self.rid)
            else:
                state.cancel(self.rid)  # disconnect, error or stop string: free its pages now
