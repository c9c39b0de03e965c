"""Loading checkpoints (mlx_attn.lm.loading): GGUF files and Hugging Face
directories, round trips, and damaged or semantically wrong files, which must
give a ValueError naming the file (and the field) before anything sized by an
untrusted number is allocated."""

import json
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_attn.lm import model_store
from mlx_attn.lm.convert import convert
from mlx_attn.lm.generate import GenerationConfig, generate_tokens
from mlx_attn.lm.loading import load_decoder, load_gguf, load_hf_directory, load_model
from model_fixtures import (
    TINY_CONFIG,
    Typed,
    random_llama,
    run_capped,
    save_hf_directory,
    smollm2,
    tiny_vocabulary,
    write_llama_gguf,
)


def default_gguf():
    return model_store.fetch_model()


# ---------------------------------------------------------------- GGUF: good files
def test_default_gguf_is_quantized_gqa_llama():
    model, tokenizer = smollm2()
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_traditional
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.layers[0].self_attn.q_proj.bits == 4
    assert tokenizer.vocab_size == cfg.vocab_size == 49152


def test_gguf_round_trip_of_a_tiny_llama(tmp_path):
    model = random_llama(rope_traditional=True)
    loaded, tokenizer = load_gguf(write_llama_gguf(tmp_path / "tiny.gguf", model))
    tokens = mx.array([[1, 5, 9, 200, 42]])
    np.testing.assert_allclose(np.array(loaded(tokens)), np.array(model(tokens)), atol=1e-6)
    assert loaded.config.num_hidden_layers == 2 and loaded.config.max_position_embeddings == 256
    assert tokenizer.eos_token_ids == {2} and tokenizer.bos_token_id == 1
    assert tokenizer.decode(tokenizer.encode("the cat in the hat")) == "the cat in the hat"


# ---------------------------------------------------------------- GGUF: damaged files
def test_missing_empty_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_gguf(tmp_path / "nothing.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_gguf(empty)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_gguf(foreign)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a .gguf"):
        load_decoder(other)
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ValueError, match="not a file"):
        load_gguf(tmp_path / "dir.gguf")


@pytest.mark.parametrize("keep_bytes", [64, 3_000_000, 60_000_000])
def test_truncated_gguf(tmp_path, keep_bytes):
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf(), "rb") as f:
        truncated.write_bytes(f.read(keep_bytes))
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_gguf(truncated)


def gguf_with(tmp_path, name, edit, source=None):
    """A copy of a GGUF file (default: the real model) with `edit(bytearray)` applied."""
    data = bytearray((source or default_gguf()).read_bytes())
    edit(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def set_u64(offset, value):
    def edit(data):
        data[offset : offset + 8] = value.to_bytes(8, "little")
    return edit


# MLX's own GGUF reader trusts the counts in the header and crashed (segfault)
# on the metadata-count case; the structure check must catch all of these first.
@pytest.mark.parametrize("name, edit, message", [
    ("version", lambda d: d.__setitem__(slice(4, 8), b"\xff" * 4), "unsupported GGUF version"),
    ("kv_count", set_u64(16, 2**64 - 1), "metadata entries"),
    ("tensor_count", set_u64(8, 10**6), "runs past the end"),
    ("missing_tail", lambda d: d.__delitem__(slice(len(d) - 10, None)), "ends at byte"),
])
def test_corrupted_gguf_header_gives_clear_error(tmp_path, name, edit, message):
    path = gguf_with(tmp_path, f"{name}.gguf", edit)
    with pytest.raises(ValueError, match=message) as error:
        load_gguf(path)
    assert str(path) in str(error.value) and "truncated or corrupted" in str(error.value)


def test_unknown_ggml_tensor_type(tmp_path):
    source = write_llama_gguf(tmp_path / "tiny.gguf")
    data = source.read_bytes()
    name = b"output_norm.weight"
    # tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    at = data.index(name) + len(name) + 4 + 8
    path = gguf_with(tmp_path, "type.gguf", lambda d: d.__setitem__(slice(at, at + 4), struct.pack("<I", 77)), source)
    with pytest.raises(ValueError, match="output_norm.weight' has unsupported ggml type 77"):
        load_gguf(path)


# ---------------------------------------------------------------- GGUF: wrong meaning
MISSING = None  # an override of None removes the metadata key

# (metadata overrides, tensors left out, expected message); each case keeps
# everything else of a valid tiny GGUF
GGUF_CASES = {
    "head_count_zero": (dict(llama__attention__head_count=0), (), "llama.attention.head_count must be >= 1"),
    "kv_heads_zero": (dict(llama__attention__head_count_kv=0), (), "head_count_kv must be >= 1"),
    "hidden_zero": (dict(llama__embedding_length=0), (), "llama.embedding_length must be >= 1"),
    "ffn_zero": (dict(llama__feed_forward_length=0), (), "llama.feed_forward_length must be >= 1"),
    "block_count_negative": (dict(llama__block_count=-1), (), "llama.block_count must be >= 1"),
    "hidden_not_multiple_of_heads": (dict(llama__attention__head_count=5, llama__attention__head_count_kv=5), (),
                                     r"llama.embedding_length \(64\) is not a multiple"),
    "kv_heads_do_not_divide": (dict(llama__attention__head_count_kv=3), (), "head_count_kv.*must divide"),
    "missing_block_count": (dict(llama__block_count=MISSING), (), "llama.block_count is missing"),
    "missing_hidden": (dict(llama__embedding_length=MISSING), (), "llama.embedding_length is missing"),
    "missing_heads": (dict(llama__attention__head_count=MISSING), (), "head_count is missing"),
    "block_count_string": (dict(llama__block_count="2"), (), "llama.block_count must be an integer, got str"),
    "block_count_float": (dict(llama__block_count=2.0), (), "llama.block_count must be an integer, got float"),
    "block_count_bool": (dict(llama__block_count=True), (), "llama.block_count must be an integer, got bool"),
    "per_layer_heads": (dict(llama__attention__head_count=[4, 4]), (), "head_count must be an integer, got list"),
    "eps_nan": (dict(llama__attention__layer_norm_rms_epsilon=float("nan")), (), "epsilon must be finite"),
    "eps_zero": (dict(llama__attention__layer_norm_rms_epsilon=0.0), (), "epsilon must be > 0"),
    "rope_base_negative": (dict(llama__rope__freq_base=-10.0), (), "llama.rope.freq_base must be > 0"),
    "rope_base_inf": (dict(llama__rope__freq_base=float("inf")), (), "llama.rope.freq_base must be finite"),
    "context_zero": (dict(llama__context_length=0), (), "llama.context_length must be >= 1"),
    "head_dim_odd": (dict(llama__attention__key_length=15), (), "key_length must be even"),
    "key_length_inconsistent": (dict(llama__attention__key_length=32), (), "attn_q|q_proj.*shape"),
    "value_length_differs": (dict(llama__attention__value_length=32), (), "value_length.*differs"),
    "partial_rope": (dict(llama__rope__dimension_count=8), (), "dimension_count.*differs"),
    "rope_scaling": (dict(llama__rope__scaling__type="linear"), (), "scaling.type 'linear' is not supported"),
    "architecture": (dict(general__architecture="gpt2"), (), "architecture 'gpt2' is not supported"),
    "vocab_vs_embedding": (dict(llama__vocab_size=500), (), r"embed_tokens.weight' has shape \(300, 64\)"),
    "ffn_vs_tensors": (dict(llama__feed_forward_length=128), (), r"gate_proj.weight' has shape \(96, 64\)"),
    "missing_tensor": ({}, ("blk.1.ffn_up.weight",), "layers.1.mlp.up_proj.weight' .* is missing"),
    "missing_layer": ({}, tuple(f"blk.1.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output",
                      "attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")), "holds tensors for 1 layers"),
    "tokenizer_model": (dict(tokenizer__ggml__model="bert"), (), "tokenizer.ggml.model 'bert' is not supported"),
    "tokens_not_a_list": (dict(tokenizer__ggml__tokens="abc"), (), "tokenizer.ggml.tokens must be a non-empty list"),
    "tokens_missing": (dict(tokenizer__ggml__tokens=MISSING), (), "tokenizer.ggml.tokens must be a non-empty list"),
    "merge_without_space": (dict(tokenizer__ggml__merges=["Ġt"]), (), r"merges\[0\] must be two known tokens"),
    "merge_of_unknown_tokens": (dict(tokenizer__ggml__merges=["Ġ t", "zz q"]), (), r"merges\[1\] must be two"),
    "merges_not_a_list": (dict(tokenizer__ggml__merges="Ġ t"), (), "merges must be a list"),
    "eos_out_of_range": (dict(tokenizer__ggml__eos_token_id=10**6), (), "eos_token_id must be <= 262"),
    "bos_negative": (dict(tokenizer__ggml__bos_token_id=-1), (), "bos_token_id must be >= 0"),
    "token_type_length": (dict(tokenizer__ggml__token_type=[1, 1, 3]), (), "token_type must be 263 integers"),
    "add_bos_not_bool": (dict(tokenizer__ggml__add_bos_token=1), (), "add_bos_token must be true or false"),
    "chat_template_not_text": (dict(tokenizer__chat_template=7), (), "chat_template must be a string"),
    "pre_not_text": (dict(tokenizer__ggml__pre=3), (), "tokenizer.ggml.pre must be a string"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_semantically_wrong_gguf_gives_clear_error(tmp_path, case):
    overrides, drop, message = GGUF_CASES[case]
    path = write_llama_gguf(tmp_path / f"{case}.gguf", drop=drop, **overrides)
    with pytest.raises(ValueError, match=message) as error:
        load_gguf(path)
    assert str(path) in str(error.value)


def test_duplicate_tokens_and_a_tokenizer_larger_than_the_embedding(tmp_path):
    tokens, _ = tiny_vocabulary()
    path = write_llama_gguf(tmp_path / "dup.gguf", tokenizer__ggml__tokens=tokens[:-1] + [tokens[3]])
    with pytest.raises(ValueError, match="1 duplicate tokens"):
        load_gguf(path)
    small = random_llama(rope_traditional=True, vocab_size=200)
    path = write_llama_gguf(tmp_path / "small.gguf", small, llama__vocab_size=200)
    with pytest.raises(ValueError, match="tokenizer has 263 tokens, the embedding only 200 rows"):
        load_gguf(path)


# A block count far beyond the file's tensors must fail at once, without
# building layer after layer: in a subprocess with a 4 GiB address-space cap.
@pytest.mark.parametrize("block_count, message", [
    (Typed(4, 2**32 - 1), "llama.block_count must be <= 2147483647, got 4294967295"),
    (10**6, "llama.block_count says a 1000000-layer model, the checkpoint holds tensors for 2 layers"),
    (Typed(10, 2**64 - 1), "llama.block_count must be <= 2147483647"),
])
def test_huge_block_count_fails_fast_under_a_memory_cap(tmp_path, block_count, message):
    path = write_llama_gguf(tmp_path / "huge.gguf", llama__block_count=block_count)
    result = run_capped(f"""
        import time
        from mlx_attn.lm.loading import load_gguf
        start = time.perf_counter()
        try:
            load_gguf({str(path)!r})
        except ValueError as error:
            print("ValueError:", error)
        print("seconds:", time.perf_counter() - start)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert message in result.stdout and str(path) in result.stdout
    seconds = float(result.stdout.split("seconds:")[1])
    assert seconds < 1.0


# ---------------------------------------------------------------- HF directories
@pytest.mark.parametrize("quantized", [False, True])
def test_hf_directory_round_trip(tmp_path, quantized, monkeypatch):
    from mlx_attn.lm import quantized_matmul

    # the loaded model's few-row products in float32, as MLX's quantized kernel computes them (the
    # default int16 product rounds the activations: tests/test_int8_matvec.py)
    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "float")
    model = random_llama(quantized=quantized)
    save_hf_directory(model, tmp_path / "hf", quantized)
    loaded, tokenizer = load_hf_directory(tmp_path / "hf")
    tokens = mx.array([[1, 5, 9, 200, 42]])
    np.testing.assert_allclose(np.array(loaded(tokens)), np.array(model(tokens)), atol=1e-5)
    assert tokenizer.eos_token_ids == {2}
    assert not loaded.config.rope_traditional  # HF layout: split halves


def test_hf_directory_errors(tmp_path):
    model = random_llama()
    directory = save_hf_directory(model, tmp_path / "hf")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_hf_directory(directory)
    weights.write_bytes(data)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=3)))
    with pytest.raises(ValueError, match="3-layer"):
        load_hf_directory(directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_directory(directory)
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_directory(directory)


MISSING_KEY = object()  # an edit_config value that removes the key


def edit_config(**changes):
    def edit(directory):
        path = directory / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            config.pop(key, None) if value is MISSING_KEY else config.__setitem__(key, value)
        path.write_text(json.dumps(config))
    return edit


def write_file(name, content: bytes):
    return lambda directory: (directory / name).write_bytes(content)


def edit_safetensors_header(change):
    """Rewrite model.safetensors with `change(header dict)` applied (data kept)."""
    def edit(directory):
        path = directory / "model.safetensors"
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        change(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    return edit


def set_tensor(name, value):
    def edit(directory):
        weights = mx.load(str(directory / "model.safetensors"))
        weights.pop(name) if value is None else weights.__setitem__(name, value)
        mx.save_safetensors(str(directory / "model.safetensors"), weights)
    return edit


# name -> (edit of a valid tiny HF directory, expected message)
HF_CASES = {
    "config_is_a_list": (write_file("config.json", b"[1, 2]"), "must hold a JSON object"),
    "config_not_utf8": (write_file("config.json", b"\xff\xfe{"), "not valid JSON"),
    "heads_zero": (edit_config(num_attention_heads=0), "num_attention_heads must be >= 1"),
    "heads_string": (edit_config(num_attention_heads="4"), "num_attention_heads must be an integer, got str"),
    "hidden_not_multiple": (edit_config(hidden_size=65), r"hidden_size \(65\) is not a multiple"),
    "kv_heads_do_not_divide": (edit_config(num_key_value_heads=3), "num_key_value_heads .* must divide"),
    "layers_beyond_mlx_shapes": (edit_config(num_hidden_layers=2**40), "num_hidden_layers must be <= 2147483647"),
    "vocab_vs_embedding": (edit_config(vocab_size=301), r"embed_tokens.weight' has shape \(300, 64\)"),
    "missing_hidden": (edit_config(hidden_size=MISSING_KEY), "hidden_size is missing"),
    "eps_nan": (edit_config(rms_norm_eps=float("nan")), "rms_norm_eps must be finite"),
    "rope_theta_negative": (edit_config(rope_theta=-1.0), "rope_theta must be > 0"),
    "tie_not_bool": (edit_config(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    "odd_head_dim": (edit_config(head_dim=15), "head_dim must be even"),
    "rope_scaling": (edit_config(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling is not supported"),
    "hidden_act": (edit_config(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    "model_type": (edit_config(model_type="gpt2"),
                   r"model_type 'gpt2' is not supported \(supported: .*llama, mistral"),
    "quantization_not_object": (edit_config(quantization=4), "quantization must be an object"),
    "group_size_unsupported": (edit_config(quantization={"group_size": 7, "bits": 4}), "group_size must be one of"),
    "scales_without_weight": (lambda d: (edit_config(quantization={"group_size": 32, "bits": 4})(d),
                                         set_tensor("model.layers.0.mlp.up_proj.weight", None)(d),
                                         set_tensor("model.layers.0.mlp.up_proj.scales", mx.zeros((96, 2)))(d)),
                              "up_proj.scales without .*up_proj.weight"),
    "quantization_mode_unsupported": (edit_config(quantization={"group_size": 32, "bits": 4, "mode": "mxfp4"}),
                                      "quantization.mode 'mxfp4' is not supported"),
    "generation_config_eos_out_of_vocab": (write_file("generation_config.json", b'{"eos_token_id": [2, 9999]}'),
                                           "eos_token_id must be <= 262"),
    "generation_config_eos_string": (write_file("generation_config.json", b'{"eos_token_id": "2"}'),
                                     "eos_token_id must be an integer"),
    "generation_config_not_json": (write_file("generation_config.json", b"{"), "generation_config.json is not valid"),
    "quantized_without_settings": (set_tensor("model.norm.scales", mx.zeros((64, 2))), "no quantization settings"),
    "header_length_huge": (lambda d: (d / "model.safetensors").write_bytes(
        struct.pack("<Q", 2**62) + (d / "model.safetensors").read_bytes()[8:]), "header of 4611686018427387904 bytes"),
    "header_not_json": (lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"\xff" * 64),
                        "header is not JSON"),
    "offsets_past_end": (edit_safetensors_header(lambda h: h["model.norm.weight"].__setitem__(
        "data_offsets", [0, 10**12])), "outside the"),
    "unknown_dtype": (edit_safetensors_header(lambda h: h["model.norm.weight"].__setitem__("dtype", "Q9")),
                      "has no known dtype"),
    "shape_vs_bytes": (edit_safetensors_header(lambda h: h["model.norm.weight"].__setitem__("shape", [10**9])),
                       "do not hold F32"),
    "missing_tensor": (set_tensor("model.layers.0.mlp.up_proj.weight", None), "up_proj.weight' .* is missing"),
    "extra_tensor": (set_tensor("model.layers.0.extra.weight", mx.zeros((2,))), "unexpected tensor"),
    "integer_tensor": (set_tensor("model.norm.weight", mx.zeros((64,), mx.int32)), "expected a floating-point"),
    "tokenizer_broken": (write_file("tokenizer.json", b'{"model": 5}'), "not a valid tokenizer.json"),
    "tokenizer_config_not_json": (write_file("tokenizer_config.json", b"{"), "tokenizer_config.json is not valid"),
    "eos_not_in_vocab": (write_file("tokenizer_config.json", b'{"eos_token": "<nope>"}'),
                         "eos_token '<nope>' is not in the vocabulary"),
    "add_bos_not_bool": (write_file("tokenizer_config.json", b'{"add_bos_token": "yes"}'),
                         "add_bos_token must be true or false"),
    "chat_template_number": (write_file("tokenizer_config.json", b'{"chat_template": 3}'),
                             "chat_template must be a string"),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_damaged_or_wrong_hf_directory_gives_clear_error(tmp_path, case):
    edit, message = HF_CASES[case]
    directory = save_hf_directory(random_llama(), tmp_path / "hf")
    edit(directory)
    with pytest.raises(ValueError, match=message) as error:
        load_hf_directory(directory)
    assert str(directory) in str(error.value)


def test_hf_tokenizer_larger_than_the_embedding(tmp_path):
    model = random_llama(vocab_size=200)
    directory = save_hf_directory(model, tmp_path / "hf", config=dict(TINY_CONFIG, vocab_size=200))
    with pytest.raises(ValueError, match="tokenizer has 263 tokens, the embedding only 200 rows"):
        load_hf_directory(directory)


def test_hf_huge_layer_count_fails_fast_under_a_memory_cap(tmp_path):
    directory = save_hf_directory(random_llama(), tmp_path / "hf")
    edit_config(num_hidden_layers=2**31 - 1)(directory)
    result = run_capped(f"""
        from mlx_attn.lm.loading import load_hf_directory
        try:
            load_hf_directory({str(directory)!r})
        except ValueError as error:
            print("ValueError:", error)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "says a 2147483647-layer model, the checkpoint holds tensors for 2 layers" in result.stdout


# ---------------------------------------------------------------- load_model
def test_generation_config_end_tokens_and_affine_mode_are_honoured(tmp_path):
    directory = save_hf_directory(random_llama(quantized=True), tmp_path / "hf", quantized=True)
    config = json.loads((directory / "config.json").read_text())
    config["quantization"]["mode"] = "affine"
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    _, tokenizer = load_hf_directory(directory)
    assert tokenizer.eos_token_ids == {0, 2}  # tokenizer_config's <|im_end|> and both of generation_config's
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert load_hf_directory(directory)[1].eos_token_ids == {1, 2}


def test_a_hub_name_is_refused_saying_there_is_no_hub():
    with pytest.raises(FileNotFoundError, match="'mlx-community/Llama-3.2-1B-Instruct-4bit' looks like a Hugging "
                                                "Face Hub name .* does not download from the Hugging Face Hub"):
        load_model("mlx-community/Llama-3.2-1B-Instruct-4bit")


# ---------------------------------------------------------------- conversion to mlx-lm's layout
def test_convert_round_trips_the_default_quantized_gguf(tmp_path):
    model, tokenizer = smollm2()
    out = convert(None, tmp_path / "mlx")
    config = json.loads((out / "config.json").read_text())
    # mlx-lm's quantization entry: the common setting plus the layers that differ (an 8-bit embedding here)
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["mode"] == "affine" and config["quantization_config"] == config["quantization"]
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    names = mx.load(str(out / "model.safetensors")).keys()
    assert "model.layers.0.self_attn.q_proj.scales" in names and "model.embed_tokens.biases" in names
    loaded, loaded_tokenizer = load_model(out)
    ids = tokenizer.encode("The capital of France is")
    assert loaded_tokenizer.encode("The capital of France is") == ids
    assert loaded_tokenizer.eos_token_ids == tokenizer.eos_token_ids
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    np.testing.assert_array_equal(np.array(loaded(mx.array([ids]))), np.array(model(mx.array([ids]))))
    config = GenerationConfig(max_tokens=8, stop_at_eos=False)
    assert list(generate_tokens(loaded, ids, config)) == list(generate_tokens(model, ids, config))


def test_convert_round_trips_a_float_gguf_and_refuses_a_used_target(tmp_path):
    source = write_llama_gguf(tmp_path / "tiny.gguf")
    model, _ = load_gguf(source)
    out = convert(source, tmp_path / "mlx")
    assert "quantization" not in json.loads((out / "config.json").read_text())
    loaded, _ = load_model(out)
    tokens = mx.array([[1, 5, 9, 200, 42]])
    np.testing.assert_array_equal(np.array(loaded(tokens)), np.array(model(tokens)))
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        convert(source, out)
    with pytest.raises(ValueError, match="already exists"):
        convert(source, source)


def test_load_model_names_unknown_models_and_empty_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="'no-such-model' not found.*registered decoder name.*smollm2-135m-instruct"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="empty string"):
        load_model("")
    with pytest.raises(TypeError, match="got int"):
        load_model(3)


# ---------------------------------------------------------------- mutated bytes
FUZZ_SCRIPT = """
import random, struct, sys
from pathlib import Path
from mlx_attn.lm.loading import load_gguf, load_hf_directory

def mutations(base, lo, hi, seed):
    rng = random.Random(seed)
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(lo, hi)] = rng.choice([rng.randrange(256), 0, 0xFF, ord("9"), ord("]")])
    return bytes(data)

gguf, hf = Path(sys.argv[1]), Path(sys.argv[2])
base = gguf.read_bytes()
tensor_table = base.index(b"token_embd.weight") - 20
regions = [(0, 600), (tensor_table, base.index(b"output_norm.weight") + 200)]
other, refused = [], 0
for seed in range({cases}):
    lo, hi = regions[seed % 2]
    gguf.write_bytes(mutations(base, lo, hi, seed))
    try:
        load_gguf(gguf)
    except ValueError:
        refused += 1
    except Exception as error:
        other.append(("gguf", seed, repr(error)))
weights = hf / "model.safetensors"
base = weights.read_bytes()
(header,) = struct.unpack("<Q", base[:8])
for seed in range({cases}):
    weights.write_bytes(mutations(base, 0, 8 + header, seed))
    try:
        load_hf_directory(hf)
    except ValueError:
        refused += 1
    except Exception as error:
        other.append(("safetensors", seed, repr(error)))
print("other exceptions:", other)
print("refused:", refused)
"""
FUZZ_CASES = 100


def test_mutated_headers_give_value_errors_never_crashes(tmp_path):
    """Random byte changes in the GGUF header, metadata and tensor table and in
    the safetensors header: each load succeeds or raises ValueError; a crash or
    a runaway allocation (under the memory cap) fails the subprocess."""
    gguf = write_llama_gguf(tmp_path / "fuzz.gguf")
    hf = save_hf_directory(random_llama(), tmp_path / "hf")
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ_SCRIPT.replace("{cases}", str(FUZZ_CASES)))
    result = run_capped(f"import sys; sys.argv = ['fuzz', {str(gguf)!r}, {str(hf)!r}]\n"
                        f"exec(open({str(script)!r}).read())", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "other exceptions: []" in result.stdout, result.stdout[-2000:]
    assert int(result.stdout.split("refused:")[1]) > FUZZ_CASES // 2  # the mutations do damage


def test_mlx_lm_loads_the_converted_directory_and_generates_the_same_tokens(tmp_path):
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is an optional comparison, not a dependency")
    model, tokenizer = smollm2()
    out = convert(None, tmp_path / "mlx")
    theirs, their_tokenizer = mlx_lm.load(str(out))
    ids = tokenizer.encode("The capital of France is")
    assert their_tokenizer.encode("The capital of France is") == ids
    their_tokens = [r.token for r in mlx_lm.stream_generate(theirs, their_tokenizer, ids, max_tokens=8)]
    assert their_tokens == list(generate_tokens(model, ids, GenerationConfig(max_tokens=8)))


def test_a_5_bit_checkpoint_loads_widened_for_the_cpu_and_saves_at_5_bits(tmp_path):
    """A checkpoint with 5-bit layers (as Q5_0 GGUF tensors load) is held at
    8 bits on the CPU (the integer product's width: the same codes), and
    saving it writes the 5-bit layers back byte for byte."""
    from mlx_attn.lm.convert import save_mlx_directory

    model, tokenizer = load_gguf(write_llama_gguf(tmp_path / "tiny.gguf"))
    nn.quantize(model, group_size=32, bits=5)
    first = save_mlx_directory(model, tokenizer, tmp_path / "five")
    loaded, _ = load_model(first)
    assert loaded.layers[0].self_attn.q_proj.bits == 8
    assert json.loads((first / "config.json").read_text())["quantization"]["bits"] == 5
    again = save_mlx_directory(loaded, tokenizer, tmp_path / "again")
    assert json.loads((again / "config.json").read_text()) == json.loads((first / "config.json").read_text())
    saved, resaved = (mx.load(str(d / "model.safetensors")) for d in (first, again))
    assert saved.keys() == resaved.keys()
    for name in saved:
        np.testing.assert_array_equal(np.array(resaved[name]), np.array(saved[name]), err_msg=name)
    tokens = mx.array([[1, 5, 9, 200, 42]])
    np.testing.assert_allclose(np.array(loaded(tokens)), np.array(model(tokens)), rtol=1e-2, atol=2e-2)
