"""The examples run end to end and produce what they promise."""

import importlib.util
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_cache_memory_example(tmp_path, capsys):
    example = load("kv_cache_memory")
    example.main(["--out", str(tmp_path / "kv.png")])
    printed = capsys.readouterr().out
    assert (tmp_path / "kv.png").stat().st_size > 10_000
    # Llama-3-8B with its 8 KV heads: 128 KiB per token, 1 GiB at 8K context
    assert "| Llama-3-8B | GQA (actual) | 8 | 128.0 KiB | 256.0 MiB | 1.0 GiB |" in printed


def test_visualize_attention_example(tmp_path):
    example = load("visualize_attention")
    weights = example.main(["--out", str(tmp_path / "attn.png"), "--length", "12", "--window", "3"])
    assert (tmp_path / "attn.png").stat().st_size > 10_000
    for name, w in weights.items():
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        if name != "bidirectional":
            assert np.triu(w, 1).max() == 0
    window = weights["sliding window (3)"]
    assert np.tril(window, -3).max() == 0 and np.tril(weights["causal"], -3).max() > 0


def test_visualize_attention_of_the_real_model(tmp_path):
    example = load("visualize_attention")
    weights = example.main(["--model", "default", "--layer", "2", "--text", "The cat sat on the mat.",
                            "--window", "3", "--out", str(tmp_path / "model.png")])
    assert (tmp_path / "model.png").stat().st_size > 10_000
    causal = weights["causal (as trained)"]
    np.testing.assert_allclose(causal.sum(-1), 1.0, atol=1e-5)
    assert np.triu(causal, 1).max() == 0
    assert np.tril(weights["sliding window (3)"], -3).max() == 0
