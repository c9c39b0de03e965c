"""Per-request token constraints: which tokens a request may sample next.

The engine's seam is :class:`Constraint`: before each token a request
samples, the engine asks its constraint for :meth:`Constraint.allowed_mask`
(packed bits, one per vocabulary entry, 32 to an ``int32`` word, bit ``t %
32`` of word ``t // 32``) and turns it into a ``-inf`` additive bias on that
request's logits row only; after sampling it calls
:meth:`Constraint.advance` with the token. A request without a constraint
is sampled as before. End-of-sequence tokens are allowed only where the
constraint says so (the grammar accepts), so a constrained request stops
with a complete answer or runs out of ``max_tokens``. A mask with no bit
set (no way on) lets the request's stop tokens through: it ends, never
draws from an all ``-inf`` row.

:class:`JsonGrammars` builds constraints from JSON schemas with llguidance
(chosen by ``benchmarks/bench_grammar_mask.py``: about a millisecond per
schema, no torch): one llguidance tokenizer per served tokenizer (built on
first use, about a second for 49k tokens), compiled grammars cached by the
schema's canonical JSON, one :class:`GrammarConstraint` (a fresh matcher)
per request. :meth:`JsonGrammars.factory` returns what a request stores:
call it once per choice.

Anything that constrains generation (``response_format``, a required or
named tool's arguments) builds on these two: a schema in, a factory out.
"""

from __future__ import annotations

import collections
import json
import threading
import weakref
from collections.abc import Callable

import numpy as np

__all__ = ["Constraint", "GrammarConstraint", "JsonGrammars", "SchemaError", "json_grammars", "mask_words",
           "masks_to_bias", "JSON_OBJECT_SCHEMA", "JSON_OPTIONS"]

JSON_OBJECT_SCHEMA = {"type": "object"}  # response_format {"type": "json_object"}
_CACHED_GRAMMARS = 256  # compiled schemas kept per tokenizer
# One JSON text per schema: no free whitespace between tokens (a model, small
# ones above all, can otherwise emit whitespace until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class SchemaError(ValueError):
    """The grammar library rejects a schema (the message says why)."""


def mask_words(vocab_size: int) -> int:
    """``int32`` words of one packed mask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class Constraint:
    """What the engine asks of a constrained request (subclass it)."""

    def allowed_mask(self) -> np.ndarray:
        """The tokens allowed next: ``int32 [mask_words(vocab)]`` (the model's
        vocabulary), bit set = allowed."""
        raise NotImplementedError

    def advance(self, token: int) -> None:
        """The request sampled ``token`` (one of the allowed)."""
        raise NotImplementedError


def masks_to_bias(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed masks ``int32 [R, words]`` -> additive bias ``float32 [R,
    vocab_size]``: 0 where allowed, ``-inf`` elsewhere."""
    bits = np.unpackbits(np.ascontiguousarray(masks, dtype="<i4").view(np.uint8), axis=-1, bitorder="little")
    return np.where(bits[:, :vocab_size].astype(bool), np.float32(0), np.float32(-np.inf))


class GrammarConstraint(Constraint):
    """One request's position in an llguidance grammar."""

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        self.mask = np.zeros(words, dtype=np.int32)

    def allowed_mask(self) -> np.ndarray:
        self.mask[:] = 0
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        return self.mask

    def advance(self, token: int) -> None:
        # a token outside the mask only comes from the engine's way out of an
        # empty mask (an end token): the matcher keeps its error state, its
        # masks stay empty, and the request ends; nothing is raised into a step
        self.matcher.consume_token(int(token))

    @property
    def accepting(self) -> bool:
        """The text so far is a whole answer."""
        return self.matcher.is_accepting()


class JsonGrammars:
    """JSON-schema constraints for one tokenizer and model vocabulary."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self._llg = llguidance
        eos = sorted(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=eos if len(eos) != 1 else eos[0])
        self._grammars: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, schema: dict) -> str:
        """The compiled grammar of ``schema`` (cached); ``SchemaError`` when
        llguidance rejects it."""
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as error:
            raise SchemaError(str(error)) from None
        problem = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise SchemaError(problem)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > _CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def lark(self, text: str) -> str:
        """The compiled grammar of an llguidance lark grammar (cached, as
        :meth:`grammar`); ``SchemaError`` when llguidance rejects it."""
        with self._lock:
            if text in self._grammars:
                self._grammars.move_to_end(text)
                return self._grammars[text]
        grammar = self._llg.LLMatcher.grammar_from_lark(text)
        problem = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise SchemaError(problem)
        with self._lock:
            self._grammars[text] = grammar
            while len(self._grammars) > _CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def lark_factory(self, text: str) -> Callable[[], GrammarConstraint]:
        """:meth:`factory` for a lark grammar."""
        grammar = self.lark(text)
        self.constraint(grammar)
        return lambda: self.constraint(grammar)

    def constraint(self, grammar: str) -> GrammarConstraint:
        matcher = self._llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise SchemaError(matcher.get_error())
        return GrammarConstraint(matcher, mask_words(self.vocab_size))

    def factory(self, schema: dict) -> Callable[[], GrammarConstraint]:
        """A fresh constraint per call (one per choice), compiled once now."""
        grammar = self.grammar(schema)
        self.constraint(grammar)  # errors surface here, not in the engine
        return lambda: self.constraint(grammar)


_GRAMMARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GRAMMARS_LOCK = threading.Lock()


def json_grammars(tokenizer, vocab_size: int) -> JsonGrammars:
    """The :class:`JsonGrammars` of a served tokenizer (one per tokenizer and
    vocabulary size, built on first use)."""
    with _GRAMMARS_LOCK:
        per_vocab = _GRAMMARS.setdefault(tokenizer, {})
        if vocab_size not in per_vocab:
            per_vocab[vocab_size] = JsonGrammars(tokenizer, vocab_size)
        return per_vocab[vocab_size]
