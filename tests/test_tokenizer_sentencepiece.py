"""SentencePiece-style tokenizers from GGUF metadata (``tokenizer.ggml.model
== "llama"``): small vocabularies whose tokenization is worked out by hand
here (score order, byte fallback, user-defined and control tokens, space
prefix), bad metadata, and Gemma 3's real vocabulary against Hugging Face
transformers' own GGUF tokenizer conversion on Shakespeare's works and
non-ASCII samples (fixture by scripts/make_gemma3_fixtures.py)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mlx_attn.lm.tokenizer import StreamingDetokenizer, tokenizer_from_gguf_metadata
from mlx_attn.lm.validate import FieldError

FIXTURES = Path(__file__).parent / "fixtures"
SPACE = "\u2581"
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def spm_metadata(pieces: list[tuple[str, float]], user_defined=(), **extra) -> dict:
    """<pad> <eos> <bos> <unk>, the 256 byte tokens, user-defined tokens, then
    the normal ``pieces`` with their scores."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [CONTROL, CONTROL, CONTROL, 2]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    tokens += list(user_defined)
    types += [USER_DEFINED] * len(user_defined)
    tokens += [p for p, _ in pieces]
    types += [NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [s for _, s in pieces]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_space_prefix": False, **extra}


BASE = [(SPACE, -1), ("a", -2), ("b", -3), ("c", -4)]


def pieces_of(tokenizer, text):
    return [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def test_best_scoring_merge_first():
    # "abc": with "ab" scoring above "bc" the pieces are ab + c, else a + bc
    ab_first = tokenizer_from_gguf_metadata(spm_metadata(BASE + [("ab", -5), ("bc", -6)]))
    bc_first = tokenizer_from_gguf_metadata(spm_metadata(BASE + [("bc", -5), ("ab", -6)]))
    assert pieces_of(ab_first, "abc") == ["ab", "c"]
    assert pieces_of(bc_first, "abc") == ["a", "bc"]
    # spaces are U+2581 and merge like any symbol; no space prefix (Gemma)
    words = tokenizer_from_gguf_metadata(spm_metadata(BASE + [("ab", -5), (SPACE + "ab", -6)]))
    assert pieces_of(words, "ab ab") == ["ab", SPACE + "ab"]
    assert words.decode(words.encode("ab ab")) == "<bos>ab ab"
    assert words.decode(words.encode("ab ab"), skip_special_tokens=True) == "ab ab"


def test_byte_fallback_and_streaming():
    tokenizer = tokenizer_from_gguf_metadata(spm_metadata(BASE))
    assert pieces_of(tokenizer, "aé") == ["a", "<0xC3>", "<0xA9>"]
    text = "b 🙂 c"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    detok = StreamingDetokenizer(tokenizer)
    assert "".join([detok.add(t) for t in ids[1:]] + [detok.finish()]) == text


def test_user_defined_and_control_tokens():
    # user-defined tokens match whole in the raw text (Gemma's runs of spaces
    # are stored with real spaces); control tokens are special
    tokenizer = tokenizer_from_gguf_metadata(spm_metadata(BASE, user_defined=["  ", "<b>"]))
    assert pieces_of(tokenizer, "a  b<b>c") == ["a", "  ", "b", "<b>", "c"]
    assert pieces_of(tokenizer, "a<eos>") == ["a", "<eos>"]
    ids = tokenizer.encode("a  b<b>c<eos>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a  b<b>c"


def test_space_prefix_and_bos_defaults():
    metadata = spm_metadata(BASE + [(SPACE + "a", -5)])
    del metadata["tokenizer.ggml.add_space_prefix"]  # llama.cpp's default for SentencePiece: add it
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    assert pieces_of(tokenizer, "a") == [SPACE + "a"]
    assert tokenizer.add_bos and tokenizer.encode("a")[0] == 2
    assert tokenizer.decode(tokenizer.encode("a b"), skip_special_tokens=True) == "a b"


@pytest.mark.parametrize("change, key", [
    ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores"),
    ({"tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores"),
    ({"tokenizer.ggml.token_type": None}, "tokenizer.ggml.token_type"),
    ({"tokenizer.ggml.token_type": [1, 2]}, "tokenizer.ggml.token_type"),
    ({"tokenizer.ggml.unknown_token_id": 10**6}, "tokenizer.ggml.unknown_token_id"),
    ({"tokenizer.ggml.add_space_prefix": "yes"}, "tokenizer.ggml.add_space_prefix"),
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
])
def test_bad_sentencepiece_metadata(change, key):
    metadata = {**spm_metadata(BASE), **change}
    metadata = {k: v for k, v in metadata.items() if v is not None}
    with pytest.raises(FieldError, match=key.replace(".", r"\.")):
        tokenizer_from_gguf_metadata(metadata)


def test_nan_scores_are_refused():
    metadata = spm_metadata(BASE)
    metadata["tokenizer.ggml.scores"] = metadata["tokenizer.ggml.scores"][:-1] + [float("nan")]
    with pytest.raises(FieldError, match="tokenizer.ggml.scores"):
        tokenizer_from_gguf_metadata(metadata)


# ---------------------------------------------------------------- Gemma 3's vocabulary
@functools.lru_cache(maxsize=1)
def gemma3_tokenizer():
    from mlx_attn.lm.gguf_tensors import read_gguf
    from mlx_attn.lm.model_store import fetch_model

    return tokenizer_from_gguf_metadata(read_gguf(fetch_model("gemma3-270m")).metadata)


def test_gemma3_tokenizer_matches_sentencepiece_on_a_corpus():
    """Against SentencePiece itself on Shakespeare and non-ASCII samples; and
    against transformers' GGUF conversion wherever that agrees with
    SentencePiece by construction (it merges runs of more than 31 spaces as
    BPE pairs, SentencePiece takes the longest user-defined piece)."""
    from mlx_attn.lm.data import fetch_shakespeare

    reference = np.load(FIXTURES / "gemma3_tokenizer_reference.npz")
    corpus = fetch_shakespeare()
    assert hashlib.sha256(corpus.encode()).hexdigest() == str(reference["corpus_sha256"])
    texts = [corpus[start:start + length] for start, length in reference["chunks"]]
    texts += json.loads(str(reference["extra"]))
    by_sentencepiece = np.split(reference["ids"], np.cumsum(reference["lengths"])[:-1])
    by_transformers = np.split(reference["transformers_ids"], np.cumsum(reference["transformers_lengths"])[:-1])
    tokenizer = gemma3_tokenizer()
    assert len(texts) == len(by_sentencepiece) == len(by_transformers)
    compared_with_transformers = 0
    for text, expected, other in zip(texts, by_sentencepiece, by_transformers):
        got = tokenizer.encode(text)
        assert got == expected.tolist(), text[:60]
        if " " * 32 not in text:
            assert got == other.tolist(), text[:60]
            compared_with_transformers += 1
        assert tokenizer.decode(got, skip_special_tokens=True) == text
    assert compared_with_transformers >= len(texts) // 2
