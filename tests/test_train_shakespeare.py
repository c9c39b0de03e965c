"""examples/train_shakespeare.py on tiny configurations: it learns, fused
and reference attention train identically, the checkpoint reloads to the
same samples, and bad options are refused clearly."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_attn.lm.data import fetch_shakespeare

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_shakespeare.py"
TINY = ["--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--hidden", "64",
        "--context", "32", "--batch", "8"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_shakespeare", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def _tiny_config(example, backend="fused"):
    return example.Config(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden=64, context=32, backend=backend)


def _train_tiny(example, backend, steps, text):
    schedule = example.Schedule(lr=1e-2, steps=steps, minutes=None, warmup=5)
    return example.train(_tiny_config(example, backend), text, schedule=schedule, batch=8, eval_every=0,
                         final_eval_batches=2, log=lambda *_: None, progress=False)


def test_training_learns_and_fused_equals_reference(example):
    """Same seed, same batches: the loss falls, and fused and reference
    attention give the same losses step by step."""
    text = fetch_shakespeare()[:20000]
    losses = {backend: np.array(_train_tiny(example, backend, 30, text).losses) for backend in example.BACKENDS}
    fused, reference = losses["fused"], losses["reference"]
    assert len(fused) == 30
    assert fused[-5:].mean() < fused[:5].mean() - 0.5
    np.testing.assert_allclose(fused, reference, rtol=2e-3)


def test_checkpoint_reloads_to_the_same_weights_and_sample(example, tmp_path):
    text = fetch_shakespeare()[:20000]
    result = _train_tiny(example, "fused", 5, text)
    cfg = _tiny_config(example)
    cfg.vocab_size = result.tokenizer.vocab_size
    example.save_outputs(tmp_path, result, cfg)
    assert (tmp_path / "loss_curve.png").stat().st_size > 10_000
    model, tokenizer, loaded_cfg = example.load_checkpoint(tmp_path)
    assert loaded_cfg == cfg and tokenizer.chars == result.tokenizer.chars
    saved = dict(nn.utils.tree_flatten(result.model.parameters()))
    for name, value in nn.utils.tree_flatten(model.parameters()):
        assert mx.array_equal(value, saved[name]), name
    before = example.sample(result.model, result.tokenizer, "ROMEO.\n", 60, 0.8, seed=7)
    after = example.sample(model, tokenizer, "ROMEO.\n", 60, 0.8, seed=7)
    assert after == before and len(after) == len("ROMEO.\n") + 60


def test_main_writes_summary_and_sample_from_reproduces_it(example, tmp_path, capsys):
    """The command line end to end: summary.json holds the numbers the
    closing note needs, and --sample-from the checkpoint prints the same
    sample for the same seed."""
    summary = example.main([*TINY, "--steps", "4", "--eval-every", "2", "--sample-length", "40",
                            "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == summary
    assert summary["steps"] == 4 and summary["tokens_trained"] == 4 * 8 * 32
    assert [step for step, _ in summary["val_curve"]] == [2, 4]
    assert math.isclose(summary["val_bits_per_char"], summary["val_loss_nats_per_char"] / math.log(2), rel_tol=1e-3)
    assert 0 < summary["val_loss_nats_per_char"] < 6 and summary["tokens_per_s"] > 0
    assert summary["sample"].startswith("ROMEO.\n") and len(summary["sample"]) == len("ROMEO.\n") + 40
    printed = capsys.readouterr().out
    assert "validation loss" in printed and summary["sample"] in printed
    again = example.main(["--sample-from", str(tmp_path), "--sample-length", "40"])
    assert again == summary["sample"]


def test_without_matplotlib_the_run_is_kept_and_the_plot_skipped_with_a_note(example, tmp_path, capsys,
                                                                             monkeypatch):
    """matplotlib is no dependency of the package: the run says so before
    training and saves everything but the PNG (the losses as JSON)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    summary = example.main([*TINY, "--steps", "3", "--eval-every", "0", "--sample-length", "10",
                            "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install matplotlib" in err
    assert err.index("matplotlib") < err.index("step 1 loss")  # said before training
    assert not (tmp_path / "loss_curve.png").exists()
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["training"]) == summary["steps"] == 3
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "summary.json").is_file()


@pytest.mark.parametrize(
    "option, value",
    [("--minutes", "0"), ("--minutes", "nan"), ("--backend", "fussed"), ("--context", "0"), ("--batch", "-1"),
     ("--lr", "-0.1"), ("--temperature", "0"), ("--eval-every", "-5")],
)
def test_bad_options_are_refused_naming_the_option(example, option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args([option, value])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_empty_prompt_is_refused(example, capsys):
    with pytest.raises(SystemExit):
        example.parse_args(["--prompt", ""])
    assert "--prompt" in capsys.readouterr().err


def test_prompt_outside_the_vocabulary_is_refused_before_training(example, tmp_path):
    with pytest.raises(ValueError, match="--prompt: character '\\xe9' is not in the vocabulary"):
        example.main([*TINY, "--prompt", "caf\u00e9", "--out", str(tmp_path)])
    assert not (tmp_path / "model.safetensors").exists()


def test_context_longer_than_the_text_is_a_clear_error(example):
    schedule = example.Schedule(steps=2, minutes=None)
    with pytest.raises(ValueError, match="context 100 is too long"):
        example.train(example.Config(context=100), "To be, or not. " * 60,  # 900 chars: 45 for validation
                      schedule=schedule, batch=2, log=lambda *_: None, progress=False)


def test_unknown_backend_in_config_is_a_clear_error(example):
    with pytest.raises(ValueError, match="backend must be one of"):
        example.train(example.Config(backend="fast"), "To be, or not to be. " * 100,
                      schedule=example.Schedule(steps=2, minutes=None), batch=2, progress=False)


def test_sample_from_a_directory_without_checkpoint_names_the_file(example, tmp_path):
    with pytest.raises(ValueError, match="config.json: not found"):
        example.load_checkpoint(tmp_path)


def test_schedule_warms_up_then_decays_by_steps_or_time(example):
    schedule = example.Schedule(lr=1e-3, steps=1000, minutes=2.0, warmup=10, final_fraction=0.1)
    assert math.isclose(schedule.learning_rate(0, 0.0), 1e-4)
    assert math.isclose(schedule.learning_rate(9, 0.0), 1e-3)
    assert math.isclose(schedule.learning_rate(500, 0.0), 0.55e-3)  # half way by steps: cosine midpoint
    assert math.isclose(schedule.learning_rate(100, 60.0), 0.55e-3)  # half way by time
    assert math.isclose(schedule.learning_rate(100, 120.0), 1e-4)  # budget spent: the floor
    assert math.isclose(schedule.learning_rate(2000, 0.0), 1e-4)
