"""gpt-oss conversations through OpenAI's ``openai-harmony`` library: the
prompt rendered by its encoder (tools in the developer message, calls and
results as harmony messages) and the answer read by its streaming parser.

The library needs the o200k_base vocabulary file and would download it on
first use; this server never lets it. The file is taken from, in order:
``$TIKTOKEN_ENCODINGS_BASE`` (a folder holding ``o200k_base.tiktoken``, the
library's own setting), else (or where that folder has no good file) the
served model's own vocabulary (a gpt-oss
tokenizer holds o200k_base's 199,998 ranks as its first ids) written once to
``<cache>/harmony/o200k_base.tiktoken``; the library checks the file's
SHA-256 either way. Without the library or the file,
:func:`harmony_encoding` is None and gpt-oss is served through its chat
template and :class:`mlx_attn.serve.tool_calls.HarmonyStream` instead."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
import threading
import weakref
from pathlib import Path

__all__ = ["harmony_encoding", "render_harmony", "HarmonyLibraryStream", "o200k_file_from_vocabulary",
           "VOCABULARY_FILE", "VOCABULARY_SHA256"]

log = logging.getLogger(__name__)

VOCABULARY_FILE = "o200k_base.tiktoken"
# the library's own check of the file (openai-harmony's expected hash of o200k_base)
VOCABULARY_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199_998
_ENV = "TIKTOKEN_ENCODINGS_BASE"

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # the folder the vocabulary came from -> its encoding (None: failed)
_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> encoding or None


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for bytes (GPT-2's table), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_ins[chr(byte)] = byte
        else:
            stand_ins[chr(256 + extra)] = byte
            extra += 1
    return stand_ins


def o200k_file_from_vocabulary(vocabulary: dict[str, int]) -> bytes | None:
    """The o200k_base ``.tiktoken`` file (base64 token, space, rank per line)
    from a byte-level BPE vocabulary, or None unless it is exactly that file."""
    if len(vocabulary) < O200K_RANKS:
        return None
    by_rank: list[str | None] = [None] * O200K_RANKS
    for token, rank in vocabulary.items():
        if 0 <= rank < O200K_RANKS:
            by_rank[rank] = token
    decode = _byte_decoder()
    lines = []
    for rank, token in enumerate(by_rank):
        if token is None or any(ch not in decode for ch in token):
            return None
        lines.append(base64.b64encode(bytes(decode[ch] for ch in token)) + b" %d\n" % rank)
    text = b"".join(lines)
    return text if hashlib.sha256(text).hexdigest() == VOCABULARY_SHA256 else None


def _vocabulary(tokenizer) -> dict[str, int] | None:
    for owner in (getattr(tokenizer, "backend", None), getattr(tokenizer, "wrapper", None)):
        get = getattr(owner, "get_vocab", None)
        if get is not None:
            try:
                return get()
            except Exception:  # noqa: BLE001  (a tokenizer without one: no vocabulary to take)
                return None
    return None


def _load_from(folder: str):
    """The gpt-oss encoding with the vocabulary in ``folder`` (None: the
    library is absent or refused the file); loaded once per folder."""
    if folder in _loaded:
        return _loaded[folder]
    try:
        import openai_harmony
    except ImportError:
        _loaded[folder] = None
        return None
    previous = os.environ.get(_ENV)
    os.environ[_ENV] = folder  # read by the library at load time, never a download
    try:
        encoding = openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as error:  # noqa: BLE001  (a missing or wrong file: the fallback serves)
        log.warning("openai-harmony could not load %s from %s (%s)", VOCABULARY_FILE, folder, error)
        encoding = None
    finally:
        if previous is None:
            del os.environ[_ENV]
        else:
            os.environ[_ENV] = previous
    _loaded[folder] = encoding
    return encoding


def _derived_folder(text: bytes) -> str | None:
    """A folder holding the vocabulary file ``text``: the cache's, else a temporary one."""
    from mlx_attn.lm.model_store import cache_dir

    for folder in (cache_dir() / "harmony", Path(tempfile.gettempdir()) / f"mlx_attn-harmony-{os.getuid()}"):
        path = folder / VOCABULARY_FILE
        try:
            if not (path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == VOCABULARY_SHA256):
                folder.mkdir(parents=True, exist_ok=True)
                partial = folder / f".{VOCABULARY_FILE}.{os.getpid()}"
                partial.write_bytes(text)
                partial.replace(path)
            return str(folder)
        except OSError:
            continue
    return None


def harmony_encoding(tokenizer):
    """openai-harmony's gpt-oss encoding for the model behind ``tokenizer``,
    or None when the library or its vocabulary cannot be had offline."""
    with _lock:
        try:
            return _by_tokenizer[tokenizer]
        except (KeyError, TypeError):  # TypeError: a tokenizer no weak reference can hold: decided each time
            pass
        encoding = _load_from(os.environ[_ENV]) if os.environ.get(_ENV) else None
        if encoding is None:
            vocabulary = _vocabulary(tokenizer)
            text = o200k_file_from_vocabulary(vocabulary) if vocabulary else None
            folder = _derived_folder(text) if text is not None else None
            if folder is not None:
                encoding = _load_from(folder)
        if encoding is None:
            log.warning("gpt-oss without openai-harmony or its o200k_base vocabulary: prompts go through the "
                        "chat template and answers through mlx_attn's own harmony parser (docs/serving.md)")
        try:
            _by_tokenizer[tokenizer] = encoding
        except TypeError:
            pass
        return encoding


# ---------------------------------------------------------------- the prompt
def _parameters(schema: dict | None) -> dict | None:
    """None for a tool without arguments: rendered ``() => any`` as gpt-oss was trained on."""
    if not schema or (set(schema) <= {"type", "properties"} and not schema.get("properties")):
        return None
    return schema


def render_harmony(encoding, messages: list[dict], tools: list[dict] | None,
                   reasoning_effort: str | None = None) -> str:
    """The prompt text of chat ``messages`` (as request_parsing shapes them)
    and OpenAI-form ``tools``, rendered by the library up to the assistant's
    turn: leading system and developer messages are the developer message's
    instructions, later ones developer messages in place;
    ``reasoning_effort`` the system message's ``Reasoning:`` (gpt-oss has
    low, medium, high: ``none`` and ``minimal`` as low, ``xhigh`` as high),
    the library's default (medium) when None."""
    import openai_harmony as h

    system = h.SystemContent.new()
    if reasoning_effort is not None:
        level = {"none": "low", "minimal": "low", "xhigh": "high"}.get(reasoning_effort, reasoning_effort)
        system = system.with_reasoning_effort(h.ReasoningEffort(level.capitalize()))
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    at, instructions = 0, []
    while at < len(messages) and messages[at]["role"] in ("system", "developer"):
        instructions.append(messages[at]["content"])
        at += 1
    developer = h.DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions("\n\n".join(instructions))
    if tools:
        developer = developer.with_function_tools([
            h.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                  parameters=_parameters(t["function"].get("parameters"))) for t in tools])
    if instructions or tools:
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    for message in messages[at:]:
        role, content = message["role"], message.get("content") or ""
        if role in ("system", "developer"):
            out.append(h.Message.from_role_and_content(h.Role.DEVELOPER,
                                                       h.DeveloperContent.new().with_instructions(content)))
        elif role == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, content))
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            if content or not calls:  # text beside calls: a preamble, on commentary as gpt-oss writes them
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, content)
                           .with_channel("commentary" if calls else "final"))
            for call in calls:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT,
                                                           json.dumps(call["function"]["arguments"]))
                           .with_channel("commentary").with_recipient("functions." + call["function"]["name"])
                           .with_content_type("<|constrain|>json"))
        elif role == "tool":
            out.append(h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions." + message["name"]),
                                                         content).with_channel("commentary")
                       .with_recipient("assistant"))
    try:
        tokens = encoding.render_conversation_for_completion(h.Conversation.from_messages(out), h.Role.ASSISTANT)
        return encoding.decode_utf8(tokens)
    except Exception as error:  # noqa: BLE001  (the library's own refusal: the conversation cannot be rendered)
        raise ValueError(f"openai-harmony could not render the conversation: {error}") from None


# ---------------------------------------------------------------- the answer
def _held_special(text: str) -> int:
    """Length of the end of ``text`` that may be a special token still arriving."""
    at = text.rfind("<")
    if at < 0 or "|>" in text[at:] or len(text) - at > 32:
        return 0
    return len(text) - at if text[at:at + 2] in ("<", "<|") else 0


class HarmonyLibraryStream:
    """gpt-oss's answer -> (content, calls) through the library's
    ``StreamableParser``, the interface of
    :class:`mlx_attn.serve.tool_calls.ToolCallStream`. The answer's text is
    encoded back into harmony tokens a piece at a time (a special token
    is held until whole) and fed to the parser: a message addressed
    ``to=functions.NAME`` is a call of NAME with its JSON body as arguments;
    ``final`` and addressed-to-no-one ``commentary`` text is the content,
    streamed; ``analysis`` (the reasoning) is left out. Text the parser
    refuses (not harmony messages) is given back as written."""

    def __init__(self, encoding, tool_use, read_call, opening: str = ""):
        import openai_harmony as h

        self.h, self.encoding, self.tool_use = h, encoding, tool_use
        self.parser = h.StreamableParser(encoding, role=h.Role.ASSISTANT)
        self.pending = opening  # the forced opening (in the prompt) is the answer's start
        self.message_tokens: list[int] = []  # the current message as written, header included
        self.sent_of_message = False  # some of the current message went out as content
        self.broken = False  # the parser refused the text: the rest is content as written
        self.done = 0  # messages of the parser already handled
        self._harmony_call = read_call  # tool_calls.harmony_call, passed in: that module imports this one
        self.calls: list = []

    def _feed(self, text: str) -> tuple[str, list]:
        if self.broken:
            return text, []
        content, made = "", []
        tokens = self.encoding.encode(text, allowed_special="all")
        for i, token in enumerate(tokens):
            try:
                self.parser.process(token)
            except Exception:  # noqa: BLE001  (HarmonyError: not a harmony message; given back as written)
                self.broken = True
                written = "" if self.sent_of_message else self.encoding.decode(self.message_tokens)
                return content + written + self.encoding.decode(tokens[i:]), made
            self.message_tokens.append(token)
            content_piece, calls = self._after_token()
            content, made = content + content_piece, made + calls
        return content, made

    def _visible(self) -> bool:
        return self.parser.current_recipient is None and self.parser.current_channel in ("final", "commentary")

    def _after_token(self, ended: bool = False) -> tuple[str, list]:
        parser, content, made = self.parser, "", []
        state = parser.state
        if state == self.h.StreamState.CONTENT:
            if self._visible() and parser.last_content_delta:
                content, self.sent_of_message = parser.last_content_delta, True
            if not ended:
                return content, made
        elif state == self.h.StreamState.HEADER and not ended:
            return content, made
        messages = parser.messages  # a message is done: only then read them (each read builds them all)
        while self.done < len(messages):
            message = messages[self.done]
            self.done += 1
            text_back, calls = self._close(message)
            content, made = content + text_back, made + calls
            self.message_tokens, self.sent_of_message = [], False
        return content, made

    def _close(self, message) -> tuple[str, list]:
        recipient = message.recipient or ""
        if message.author.role != self.h.Role.ASSISTANT or not recipient.startswith("functions."):
            return "", []
        body = "".join(getattr(part, "text", "") for part in message.content)
        return self._harmony_call(recipient, body, self.tool_use, self.calls)

    def add(self, text: str) -> tuple[str, list]:
        self.pending += text
        cut = len(self.pending) - _held_special(self.pending)
        ready, self.pending = self.pending[:cut], self.pending[cut:]
        return self._feed(ready) if ready else ("", [])

    def finish(self) -> tuple[str, list]:
        content, made = self._feed(self.pending) if self.pending else ("", [])
        self.pending = ""
        if self.broken:
            return content, made
        try:
            self.parser.process_eos()  # the <|call|> / <|return|> that ended the answer
        except Exception:  # noqa: BLE001  (ended inside a header: no message to show)
            return content, made
        more, calls = self._after_token(ended=True)
        return content + more, made + calls
