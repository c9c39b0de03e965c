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
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (Jinja2, as Hugging Face does)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use plain prompts")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(min(self.eos_token_ids)) if self.eos_token_ids else ""
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )


def _scalar(value):
    """GGUF metadata scalars come back as 0-d mlx arrays."""
    return value.item() if hasattr(value, "item") else value


def tokenizer_from_gguf_metadata(metadata: dict) -> Tokenizer:
    """Byte-level BPE tokenizer (GGUF ``tokenizer.ggml.model == "gpt2"``)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2' is supported)")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    backend = HFTokenizer(bpe)
    # SmolLM2 / GPT-2 style: digits split one by one, then byte-level regex split.
    pre = metadata.get("tokenizer.ggml.pre", "gpt2")
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "llama-bpe", "llama3", "qwen2", "deepseek-llm"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        types = types.tolist() if hasattr(types, "tolist") else list(types)
        special = [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
        backend.add_special_tokens(special)
    eos = _scalar(metadata.get("tokenizer.ggml.eos_token_id"))
    bos = _scalar(metadata.get("tokenizer.ggml.bos_token_id"))
    eos_ids = {eos} if eos is not None else set()
    eot = _scalar(metadata.get("tokenizer.ggml.eot_token_id"))
    if eot is not None:
        eos_ids.add(eot)
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        add_bos=bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token", False))),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def tokenizer_from_file(path: str | os.PathLike, config: dict | None = None) -> Tokenizer:
    """A Hugging Face ``tokenizer.json`` (+ optional tokenizer_config values)."""
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as error:
        raise ValueError(f"{path} is not a valid tokenizer.json: {error}") from error
    config = config or {}

    def token_id(value):
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else value

    eos = token_id(config.get("eos_token"))
    return Tokenizer(
        backend,
        bos_token_id=token_id(config.get("bos_token")),
        eos_token_ids={eos} if eos is not None else set(),
        add_bos=bool(config.get("add_bos_token", False)),
        chat_template=config.get("chat_template"),
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
