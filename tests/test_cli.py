"""The ``mlx-attn`` command (mlx_attn.lm.cli): generation, and user mistakes
that must end with exit code 2 and one readable line on stderr, never a
traceback."""

import subprocess
import sys

import pytest

from mlx_attn.lm import model_store
from mlx_attn.lm.cli import main as cli_main
from model_fixtures import write_llama_gguf


def test_cli_generates_and_reports(capsys):
    assert cli_main(["generate", "The capital of France is", "--max-tokens", "4", "--backend", "fused"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is Paris")
    assert "[fused attention]" in captured.err and "tokens/s" in captured.err and "peak memory" in captured.err
    assert cli_main(["generate", "--chat", "Hi", "--max-tokens", "2", "--quiet"]) == 0


def test_cli_reports_bad_model_paths(capsys, tmp_path):
    assert cli_main(["generate", "x", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_generates_with_a_gguf_file(capsys, tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    assert cli_main(["generate", "the", "--model", str(path), "--max-tokens", "3", "--quiet", "--temp", "0.5",
                     "--seed", "1", "--top-k", "5", "--chat"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and captured.err == ""


def assert_one_line_error(capsys, argv, message):
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("mlx-attn") and message in err, err
    return captured


@pytest.mark.parametrize("options, message", [
    (["--seed", "-1"], "seed must be >= 0, got -1"),
    (["--seed", str(2**64)], "seed must be <="),
    (["--temp", "nan"], "temperature must be finite, got nan"),
    (["--temp", "inf"], "temperature must be finite"),
    (["--temp", "-1"], "temperature must be >= 0"),
    (["--top-p", "2"], "top_p must be <= 1.0"),
    (["--top-k", "-3"], "top_k must be >= 0"),
    (["--min-p", "nan"], "min_p must be finite"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--max-tokens", "-5"], "max_tokens must be >= 0, got -5"),
    (["--prefill-chunk", "0"], "prefill_chunk must be >= 1"),
    (["--max-tokens", "abc"], "argument --max-tokens: invalid int value: 'abc'"),
    (["--seed", "1.5"], "argument --seed: invalid int value"),
    (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--model", ""], "empty string"),
    (["--model", "no-such-model"], "'no-such-model' not found"),
    (["--system", "caf\udce9", "--chat"], "--system is not valid UTF-8"),
])
def test_option_mistakes(capsys, options, message):
    captured = assert_one_line_error(capsys, ["generate", "Hello", *options], message)
    assert captured.out == ""  # nothing generated, not even the prompt echoed


def test_missing_prompt_or_command(capsys):
    assert_one_line_error(capsys, ["generate"], "the following arguments are required: prompt")
    assert_one_line_error(capsys, [], "the following arguments are required: command")
    assert_one_line_error(capsys, ["train"], "invalid choice: 'train'")


def test_huge_max_tokens_is_refused_before_printing(capsys):
    captured = assert_one_line_error(capsys, ["generate", "Hello", "--max-tokens", str(10**9)],
                                     "exceed the model's context length of 8192")
    assert captured.out == ""


def test_damaged_and_wrong_model_files(capsys, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(model_store.fetch_model(), "rb") as f:
        truncated.write_bytes(f.read(5000))
    assert_one_line_error(capsys, ["generate", "x", "--model", str(truncated)], "truncated or corrupted")
    zero_heads = write_llama_gguf(tmp_path / "zero.gguf", llama__attention__head_count=0)
    assert_one_line_error(capsys, ["generate", "x", "--model", str(zero_heads)],
                          "llama.attention.head_count must be >= 1")
    (tmp_path / "empty_dir").mkdir()
    assert_one_line_error(capsys, ["generate", "x", "--model", str(tmp_path / "empty_dir")], "config.json not found")
    broken_template = write_llama_gguf(tmp_path / "template.gguf", tokenizer__chat_template="{% for %}")
    assert_one_line_error(capsys, ["generate", "x", "--chat", "--model", str(broken_template)],
                          "chat template failed: TemplateSyntaxError")
    no_template = write_llama_gguf(tmp_path / "none.gguf", tokenizer__chat_template=None)
    assert_one_line_error(capsys, ["generate", "x", "--chat", "--model", str(no_template)], "no chat template")


def test_non_utf8_prompt_bytes_in_a_real_process(tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    result = subprocess.run([sys.executable, "-m", "mlx_attn.lm.cli", "generate", b"caf\xe9", "--model", str(path)],
                            capture_output=True)
    err = result.stderr.decode("utf-8", "replace").strip()
    assert result.returncode == 2 and result.stdout == b""
    assert err == "mlx-attn: error: the prompt is not valid UTF-8 text (it holds undecodable bytes)"
