"""Tokenizers for the models: built from GGUF metadata or read from a Hugging
Face ``tokenizer.json``, both with the ``tokenizers`` library; chat templates
rendered with Jinja2 like Hugging Face does."""

from __future__ import annotations

import math
import os
from typing import Iterable

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from mlx_attn.lm.validate import FieldError, require_bool, require_int, require_str, require_utf8

__all__ = ["Tokenizer", "tokenizer_from_gguf_metadata", "tokenizer_from_file", "StreamingDetokenizer"]

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


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

    def add_eos_token(self, token: str) -> None:
        """One more token (by its text) that ends generation."""
        require_utf8("the end token", token)
        found = self.backend.token_to_id(token)
        if found is None:
            raise ValueError(f"end token {token!r} is not in the vocabulary")
        self.eos_token_ids.add(found)

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

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render the model's chat template (Jinja2, as Hugging Face does);
        ``tools``: function definitions (OpenAI's form) for templates that
        render them. Messages may carry more keys (``tool_calls``, ...)."""
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
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
                tools=tools,
            )
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"the model's chat template failed: {type(error).__name__}: {error}") from None
        if not isinstance(rendered, str):
            raise ValueError("the model's chat template did not render text")
        return rendered


def _token_id(field: str, value, n_tokens: int) -> int | None:
    return None if value is None else require_int(field, value, 0, n_tokens - 1)


def tokenizer_from_gguf_metadata(metadata: dict) -> Tokenizer:
    """Tokenizer from GGUF metadata as plain Python values: byte-level BPE
    (``tokenizer.ggml.model == "gpt2"``) or SentencePiece-style BPE
    (``"llama"``: Llama 2, Gemma); a FieldError names the bad key."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise FieldError("tokenizer.ggml.model",
                         f"{kind!r} is not supported (only byte-level BPE 'gpt2' and SentencePiece 'llama')")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise FieldError("tokenizer.ggml.tokens", "must be a non-empty list of strings")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise FieldError("tokenizer.ggml.tokens", f"holds {len(tokens) - len(vocab)} duplicate tokens")
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
            raise FieldError("tokenizer.ggml.token_type", f"must be {len(tokens)} integers, one per token")
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, vocab, types)
    else:
        backend = _sentencepiece_bpe(metadata, tokens, vocab, types)
    ids = {key: _token_id(f"tokenizer.ggml.{key}", metadata.get(f"tokenizer.ggml.{key}"), len(tokens))
           for key in ("bos_token_id", "eos_token_id", "eot_token_id")}
    template = metadata.get("tokenizer.chat_template")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos_default = kind == "llama"
    return Tokenizer(
        backend,
        bos_token_id=ids["bos_token_id"],
        eos_token_ids={i for i in (ids["eos_token_id"], ids["eot_token_id"]) if i is not None},
        add_bos=require_bool("tokenizer.ggml.add_bos_token",
                             metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=None if template is None else require_str("tokenizer.chat_template", template),
    )


def _byte_level_bpe(metadata: dict, tokens: list[str], vocab: dict, types: list[int] | None) -> HFTokenizer:
    """GPT-2 style: byte-level symbols, merges listed in the file."""
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if raw_merges is None:
        # without merges a BPE model splits every word into single bytes: silently wrong
        raise FieldError("tokenizer.ggml.merges", "is missing (a byte-level BPE tokenizer needs its merges)")
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
    if types is not None:
        backend.add_special_tokens([tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)])
    return backend


_SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the adjacent pair whose concatenation is the
    best-scoring normal piece; as ranked merges that is every split ``a + b``
    of a normal piece into two pieces, best merged score first."""
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] == _NORMAL}
    merges = []
    for token, index in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-scores[index], index, mergeable[left], mergeable[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _sentencepiece_bpe(metadata: dict, tokens: list[str], vocab: dict, types: list[int] | None) -> HFTokenizer:
    """SentencePiece-style BPE (GGUF ``tokenizer.ggml.model == "llama"``):
    spaces become U+2581, pieces merge best score first, characters outside
    the vocabulary fall back to ``<0xNN>`` byte tokens; control tokens are
    special, user-defined ones (Gemma: runs of spaces, newlines, tabs, HTML
    tags) are matched whole in the raw text, as SentencePiece and llama.cpp do."""
    if types is None:
        raise FieldError("tokenizer.ggml.token_type", "is missing (a SentencePiece vocabulary needs it)")
    scores = metadata.get("tokenizer.ggml.scores")
    if (not isinstance(scores, list) or len(scores) != len(tokens)
            or not all(isinstance(s, (int, float)) and math.isfinite(s) for s in scores)):
        raise FieldError("tokenizer.ggml.scores", f"must be {len(tokens)} finite numbers, one per token")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    missing = [t for t in byte_tokens if t not in vocab]
    byte_fallback = not missing
    if missing and len(missing) < 256:
        raise FieldError("tokenizer.ggml.tokens", f"holds some byte tokens but not {missing[0]!r}")
    unk_id = _token_id("tokenizer.ggml.unknown_token_id", metadata.get("tokenizer.ggml.unknown_token_id"),
                       len(tokens))
    unk = tokens[unk_id] if unk_id is not None else None
    # models.BPE needs the vocabulary as spelled in the text it merges
    merges = _sentencepiece_merges(tokens, scores, types)
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                         byte_fallback=byte_fallback))
    except Exception as error:  # the tokenizers library raises its own Exception type
        raise FieldError("tokenizer.ggml.tokens", f"do not form a BPE model: {error}") from None
    add_prefix = require_bool("tokenizer.ggml.add_space_prefix",
                              metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_prefix else [])
    )
    backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])
    backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                for i, t in enumerate(types) if t == _CONTROL])
    return backend


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
