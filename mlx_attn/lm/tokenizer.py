"""Tokenizers for the models: built from GGUF metadata or read from a Hugging
Face ``tokenizer.json``, both with the ``tokenizers`` library; chat templates
rendered with Jinja2 like Hugging Face does."""

from __future__ import annotations

import os
from typing import Iterable

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from mlx_attn.lm.validate import FieldError, require_bool, require_int, require_str, require_utf8

__all__ = ["Tokenizer", "tokenizer_from_gguf_metadata", "tokenizer_from_file", "StreamingDetokenizer"]

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """Encode/decode text, know the special tokens, apply the chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        require_utf8("text", text)
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids; an id outside the vocabulary is an error (the
        tokenizers library would silently drop it)."""
        last = self.vocab_size - 1
        ids = [require_int(f"token id at position {i}", t, 0, last) for i, t in enumerate(ids)]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (Jinja2, as Hugging Face does)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use plain prompts")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(min(self.eos_token_ids)) if self.eos_token_ids else ""
        # the template is code from the model file: whatever goes wrong in it
        # is a broken template, not a bug of the caller
        try:
            template = env.from_string(self.chat_template)
            rendered = template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
            )
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"the model's chat template failed: {type(error).__name__}: {error}") from None
        if not isinstance(rendered, str):
            raise ValueError("the model's chat template did not render text")
        return rendered


def _token_id(field: str, value, n_tokens: int) -> int | None:
    return None if value is None else require_int(field, value, 0, n_tokens - 1)


def tokenizer_from_gguf_metadata(metadata: dict) -> Tokenizer:
    """Byte-level BPE tokenizer (GGUF ``tokenizer.ggml.model == "gpt2"``) from
    metadata as plain Python values; a FieldError names the bad key."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise FieldError("tokenizer.ggml.model",
                         f"{kind!r} is not supported (only byte-level BPE 'gpt2' is)")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise FieldError("tokenizer.ggml.tokens", "must be a non-empty list of strings")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise FieldError("tokenizer.ggml.tokens", f"holds {len(tokens) - len(vocab)} duplicate tokens")
    raw_merges = metadata.get("tokenizer.ggml.merges", [])
    if not isinstance(raw_merges, list):
        raise FieldError("tokenizer.ggml.merges", "must be a list of strings")
    merges = []
    for index, merge in enumerate(raw_merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not all(part in vocab for part in parts):
            raise FieldError(f"tokenizer.ggml.merges[{index}]",
                             f"must be two known tokens separated by one space, got {merge!r}")
        merges.append(tuple(parts))
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as error:  # the tokenizers library raises its own Exception type
        raise FieldError("tokenizer.ggml.merges", f"do not form a BPE model: {error}") from None
    # SmolLM2 / GPT-2 style: digits split one by one, then byte-level regex split.
    pre = require_str("tokenizer.ggml.pre", metadata.get("tokenizer.ggml.pre", "gpt2"))
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "llama-bpe", "llama3", "qwen2", "deepseek-llm"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
            raise FieldError("tokenizer.ggml.token_type", f"must be {len(tokens)} integers, one per token")
        backend.add_special_tokens([tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)])
    ids = {key: _token_id(f"tokenizer.ggml.{key}", metadata.get(f"tokenizer.ggml.{key}"), len(tokens))
           for key in ("bos_token_id", "eos_token_id", "eot_token_id")}
    template = metadata.get("tokenizer.chat_template")
    return Tokenizer(
        backend,
        bos_token_id=ids["bos_token_id"],
        eos_token_ids={i for i in (ids["eos_token_id"], ids["eot_token_id"]) if i is not None},
        add_bos=require_bool("tokenizer.ggml.add_bos_token", metadata.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=None if template is None else require_str("tokenizer.chat_template", template),
    )


def _chat_template(value) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named
    templates of which the ``default`` one is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return require_str("chat_template", entry.get("template"))
    raise FieldError("chat_template", "must be a string or a list of named templates with a 'default' one")


def tokenizer_from_file(path: str | os.PathLike, config: dict | None = None) -> Tokenizer:
    """A Hugging Face ``tokenizer.json`` (+ optional tokenizer_config values);
    a FieldError names the bad tokenizer_config key."""
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library raises its own Exception type
        raise ValueError(f"{path} is not a valid tokenizer.json: {error}") from None
    config = config or {}
    if not isinstance(config, dict):
        raise FieldError("tokenizer_config", "must be a JSON object")

    def token_id(field):
        value = config.get(field)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return None
        token = require_str(field, value)
        found = backend.token_to_id(token)
        if found is None:
            raise FieldError(field, f"{token!r} is not in the vocabulary")
        return found

    eos = token_id("eos_token")
    return Tokenizer(
        backend,
        bos_token_id=token_id("bos_token"),
        eos_token_ids={eos} if eos is not None else set(),
        add_bos=require_bool("add_bos_token", config.get("add_bos_token") or False),
        chat_template=_chat_template(config.get("chat_template")),
    )


class StreamingDetokenizer:
    """Turns generated token ids into text pieces as soon as they are complete
    (with byte-level BPE one character may span several tokens). Decodes only
    the tokens since the last complete piece, so streaming stays O(n)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []

    def add(self, token: int) -> str:
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
            return ""
        self.pending = []
        return text

    def finish(self) -> str:
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending = []
        return text
