"""``POST /v1/embeddings``: a sentence encoder (the BERT encoder of
:mod:`mlx_attn.lm.models.bert`, all-MiniLM-L6-v2 by default) served beside
the chat model when the server is started with ``--embedding-model``.

Inputs as OpenAI takes them: a string, a list of strings, a list of token
ids, or a list of such lists (ids of the encoder's own vocabulary; the
encoder's start and end tokens are added around them as around a string's).
Every input is checked against the encoder's context before any is encoded
(a 400 naming ``input``); all are encoded in a few padded batches, on the
engine's thread. ``encoding_format`` ``float`` (lists) or ``base64`` (the
little-endian float32 bytes)."""

from __future__ import annotations

import base64

import numpy as np

from mlx_attn.serve.api_error import APIError

__all__ = ["EmbeddingModel", "MAX_INPUTS"]

MAX_INPUTS = 2048  # as OpenAI
_BATCH = 32  # inputs per forward pass (sorted by length: little padding)
_FORMATS = ("float", "base64")


class EmbeddingModel:
    """A named sentence encoder and its answers to embedding requests."""

    def __init__(self, encoder, name: str):
        self.encoder, self.name = encoder, name
        self.context = encoder.max_length
        self.vocab_size = encoder.tokenizer.get_vocab_size()
        around = encoder.tokenizer.encode("").ids  # the special tokens a text gets: [CLS] [SEP] for BERT
        self.prefix, self.suffix = around[:1], around[1:]

    # ------------------------------------------------------------ parsing
    def _inputs(self, body: dict) -> list[list[int]]:
        value = body.get("input")
        if isinstance(value, str) or _is_token_list(value):
            value = [value]
        if not isinstance(value, list) or not value:
            raise APIError(400, "input must be a string, a list of strings, a list of token ids or a list of such "
                                "lists, not empty", "input")
        if len(value) > MAX_INPUTS:
            raise APIError(400, f"input holds {len(value)} items; at most {MAX_INPUTS}", "input")
        sequences = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate from the JSON body
                    raise APIError(400, f"input[{i}] is not valid UTF-8 text", "input") from None
                ids = self.encoder.tokenizer.encode(item).ids
            elif _is_token_list(item) and item:
                if not all(0 <= t < self.vocab_size for t in item):
                    raise APIError(400, f"input[{i}] holds token ids outside [0, {self.vocab_size})", "input")
                ids = self.prefix + list(item) + self.suffix
            else:
                raise APIError(400, f"input[{i}] must be a string or a non-empty list of token ids", "input")
            if len(ids) > self.context:
                raise APIError(400, f"input[{i}] has {len(ids)} tokens; the embedding model's context is "
                                    f"{self.context}", "input", "context_length_exceeded")
            sequences.append(ids)
        return sequences

    def _check(self, body: dict) -> str:
        model = body.get("model", self.name)
        if model is not None and model != self.name:
            raise APIError(404, f"model {model!r} does not exist; the embedding model is {self.name!r}", "model",
                           "model_not_found")
        form = body.get("encoding_format") or "float"
        if form not in _FORMATS:
            raise APIError(400, f"encoding_format must be one of {', '.join(_FORMATS)}", "encoding_format")
        dimensions = body.get("dimensions")
        width = self.encoder.model.config.hidden_size
        if dimensions is not None and dimensions != width:
            raise APIError(400, f"dimensions: this model's embeddings have {width} dimensions only", "dimensions")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise APIError(400, "user must be a string", "user")
        return form

    # ------------------------------------------------------------ answering
    def embed(self, sequences: list[list[int]]) -> np.ndarray:
        """``float32 [len(sequences), hidden]``; call it on the engine's thread."""
        import mlx.core as mx

        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = np.empty((len(sequences), self.encoder.model.config.hidden_size), np.float32)
        for start in range(0, len(order), _BATCH):
            chunk = order[start:start + _BATCH]
            vectors = self.encoder.encode_tokens([sequences[i] for i in chunk]).astype(mx.float32)
            out[chunk] = np.array(vectors)
        return out

    async def answer(self, state, body: dict) -> dict:
        """The response body of an embeddings request (``state``: the
        :class:`ServerState` whose engine thread runs the encoder)."""
        form = self._check(body)
        sequences = self._inputs(body)
        vectors = await state.call(self.embed, sequences)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if form == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        tokens = sum(len(s) for s in sequences)
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _is_token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
