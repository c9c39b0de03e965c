"""The ``mlx-attn`` command (mlx_attn.lm.cli): generation, and user mistakes
that must end with exit code 2 and one readable line on stderr, never a
traceback."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_attn.cache import KVCache, QuantizedKVCache, load_cache, save_cache
from mlx_attn.lm import load_model, model_store
from mlx_attn.lm.cli import main as cli_main
from model_fixtures import random_llama, smollm2, tiny_vocabulary, write_llama_gguf


def test_cli_generates_and_reports(capsys):
    assert cli_main(["generate", "The capital of France is", "--max-tokens", "4", "--backend", "fused",
                     "--ignore-chat-template"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is Paris")
    assert "[fused attention] Prompt: " in captured.err and "tokens-per-sec" in captured.err
    assert re.search(r"Peak memory: \d+\.\d{3} GB$", captured.err.strip())
    assert cli_main(["generate", "--chat", "Hi", "--max-tokens", "2", "--quiet"]) == 0


def test_prompt_flag_and_positional_prompt_are_the_same(capsys):
    outputs = []
    for argv in (["--prompt", "The capital of France is"], ["-p", "The capital of France is"],
                 ["The capital of France is"]):
        assert cli_main(["generate", *argv, "-m", "3", "--quiet"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].strip()


def test_chat_template_applies_by_default_for_instruct_models(capsys):
    runs = {}
    for name, flags in (("default", []), ("chat", ["--chat"]), ("plain", ["--ignore-chat-template"])):
        assert cli_main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
                         *flags]) == 0
        runs[name] = capsys.readouterr()
    _, tokenizer = smollm2()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    templated = len(tokenizer.encode(tokenizer.apply_chat_template(question), add_special_tokens=False))
    plain = len(tokenizer.encode("What is the capital of France?"))
    assert templated > plain
    assert runs["default"].out == runs["chat"].out
    assert f"Prompt: {templated} tokens" in runs["default"].err
    assert runs["plain"].out.startswith("What is the capital of France?")  # a plain prompt is echoed
    assert f"Prompt: {plain} tokens" in runs["plain"].err
    assert cli_main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
                     "--system-prompt", "Answer in French."]) == 0
    assert f"Prompt: {templated} tokens" not in capsys.readouterr().err  # the system message is in the prompt


def test_verbose_prints_as_mlx_lm(capsys):
    assert cli_main(["generate", "--prompt", "Hi", "--max-tokens", "3", "--verbose"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert lines[0] == "==========" and lines[-4] == "=========="
    assert lines[-3].startswith("Prompt: ") and lines[-2].startswith("Generation: 3 tokens, ")
    assert re.fullmatch(r"Peak memory: \d+\.\d{3} GB", lines[-1])
    assert cli_main(["generate", "--prompt", "Hi", "--max-tokens", "3", "--verbose", "False", "--quiet"]) == 0
    assert "==========" not in capsys.readouterr().out


def test_extra_eos_token_ends_generation(capsys):
    base = ["generate", "--prompt", "The capital of France is", "--ignore-chat-template", "--max-tokens", "6",
            "--quiet"]
    assert cli_main(base) == 0
    assert capsys.readouterr().out.startswith("The capital of France is Paris.")
    assert cli_main([*base, "--extra-eos-token", "."]) == 0
    assert capsys.readouterr().out == "The capital of France is Paris\n"


def test_max_kv_size_and_prefill_step_size(capsys):
    outputs = []
    for flags in (["--prefill-step-size", "4"], ["--prefill-chunk", "4"], ["--max-kv-size", "64"], []):
        assert cli_main(["generate", "--prompt", "Tell me about Paris.", "-m", "6", "--quiet", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert len(set(outputs)) == 1  # neither changes greedy output (the window holds everything)
    assert cli_main(["generate", "--prompt", "Tell me about Paris.", "-m", "20", "--quiet",
                     "--max-kv-size", "16"]) == 0
    assert capsys.readouterr().out.strip()


def tiny_gguf(path):
    """A tiny GGUF whose embedding has exactly the tokenizer's rows, so
    every generated id decodes."""
    vocab = len(tiny_vocabulary()[0])
    return str(write_llama_gguf(path, model=random_llama(rope_traditional=True, vocab_size=vocab),
                                llama__vocab_size=vocab))


def test_prompt_cache_file_gives_the_same_output_as_the_whole_prompt(capsys, tmp_path):
    model = tiny_gguf(tmp_path / "tiny.gguf")
    cache_file = str(tmp_path / "prefix.safetensors")
    prefix, rest = "the then in the ", "then in"
    for flags in ([], ["--ignore-chat-template"]):
        assert cli_main(["cache-prompt", "--model", model, "--prompt", prefix, "--prompt-cache-file", cache_file,
                         *flags]) == 0
        assert "cached" in capsys.readouterr().err
        assert cli_main(["generate", "--model", model, "--prompt", prefix + rest, "-m", "6", "--quiet",
                         *flags]) == 0
        whole = capsys.readouterr().out
        assert cli_main(["generate", "--prompt-cache-file", cache_file, "--prompt", rest, "-m", "6",
                         *flags]) == 0  # the model is the one the cache names
        cached = capsys.readouterr()
        assert whole.endswith(cached.out) and cached.out.strip()
        assert "Prompt: " in cached.err
        Path(cache_file).unlink()


def test_prompt_cache_mistakes(capsys, tmp_path):
    model = tiny_gguf(tmp_path / "tiny.gguf")
    other = tiny_gguf(tmp_path / "other.gguf")
    cache_file = str(tmp_path / "c.safetensors")
    assert cli_main(["cache-prompt", "--model", model, "--prompt", "the", "--prompt-cache-file", cache_file]) == 0
    capsys.readouterr()
    assert_one_line_error(capsys, ["generate", "--model", other, "--prompt-cache-file", cache_file, "x"],
                          "was made with --model")
    relative = os.path.relpath(model)  # the same model named another way is the same model
    assert cli_main(["generate", "--model", relative, "--prompt-cache-file", cache_file, "x", "-m", "2",
                     "--quiet"]) == 0
    capsys.readouterr()
    assert_one_line_error(capsys, ["generate", "--prompt-cache-file", str(tmp_path / "none.safetensors"), "x"],
                          "no cache file")
    foreign = tmp_path / "foreign.safetensors"
    save_cache(str(foreign), [KVCache()])
    assert_one_line_error(capsys, ["generate", "--prompt-cache-file", str(foreign), "x"],
                          "was not made by 'mlx-attn cache-prompt'")


def tiny_gguf_head32(path: Path) -> str:
    """A tiny Llama GGUF with head dimension 32 (a KV quantization group of
    32 fits a head)."""
    vocab = len(tiny_vocabulary()[0])
    model = random_llama(rope_traditional=True, vocab_size=vocab, num_attention_heads=2, num_key_value_heads=1)
    return str(write_llama_gguf(path, model=model, llama__vocab_size=vocab, llama__attention__head_count=2,
                                llama__attention__head_count_kv=1))


QUANTIZED = ["--kv-bits", "8", "--kv-group-size", "32"]


def test_cache_prompt_with_kv_bits_saves_a_quantized_cache_that_continues_like_the_whole_prompt(capsys, tmp_path):
    model = tiny_gguf_head32(tmp_path / "tiny.gguf")
    cache_file = str(tmp_path / "prefix.safetensors")
    prefix, rest = "the then in the ", "then in"
    assert cli_main(["cache-prompt", "--model", model, "--prompt", prefix, "--prompt-cache-file", cache_file,
                     "--ignore-chat-template", *QUANTIZED]) == 0
    assert "8-bit quantized" in capsys.readouterr().err
    caches, _ = load_cache(cache_file)
    assert all(isinstance(c, QuantizedKVCache) and (c.bits, c.group_size) == (8, 32) for c in caches)
    assert cli_main(["generate", "--model", model, "--prompt", prefix + rest, "-m", "6", "--quiet",
                     "--ignore-chat-template", *QUANTIZED]) == 0
    whole = capsys.readouterr().out
    assert cli_main(["generate", "--prompt-cache-file", cache_file, "--prompt", rest, "-m", "6", "--quiet",
                     "--ignore-chat-template", *QUANTIZED]) == 0
    cached = capsys.readouterr()
    assert cached.out.strip() and whole.endswith(cached.out) and cached.err == ""


def test_a_prompt_cache_file_of_quantized_layers_generates(capsys, tmp_path):
    """A valid save_cache file of a quantized cache, made with the library."""
    model_path = tiny_gguf_head32(tmp_path / "tiny.gguf")
    model, tokenizer = load_model(model_path)
    ids = tokenizer.encode("the then in the ")
    caches = model.make_cache()
    model(mx.array([ids]), cache=caches)
    caches = [c.to_quantized(group_size=32, bits=8) for c in caches]
    cache_file = str(tmp_path / "quantized.safetensors")
    save_cache(cache_file, caches, {"mlx_attn.model": str(Path(model_path).resolve()), "mlx_attn.prompt":
                                    "the then in the ", "mlx_attn.token_ids": json.dumps(ids)})
    assert cli_main(["generate", "--prompt-cache-file", cache_file, "--prompt", "then", "-m", "4",
                     "--ignore-chat-template"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "Prompt: " in captured.err and "error" not in captured.err


@pytest.mark.parametrize("command", ["generate", "cache-prompt"])
def test_a_kv_group_size_that_does_not_divide_the_head_is_refused_before_any_output(capsys, tmp_path, command):
    model = tiny_gguf(tmp_path / "tiny.gguf")  # head dimension 16
    extra = ["--prompt-cache-file", str(tmp_path / "c.safetensors")] if command == "cache-prompt" else []
    captured = assert_one_line_error(
        capsys, [command, "--model", model, "--prompt", "the then", "--ignore-chat-template", *QUANTIZED, *extra],
        "--kv-group-size (32) must divide the model's head dimension (16)")
    assert captured.out == "" and not (tmp_path / "c.safetensors").exists()


def test_an_encoder_name_is_not_offered_to_generate_and_is_refused_clearly(capsys):
    from mlx_attn.lm.cli import build_parser

    generate_help = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "smollm2-135m-instruct" in generate_help and "all-minilm-l6-v2" not in generate_help
    assert_one_line_error(capsys, ["generate", "--model", "all-minilm-l6-v2", "x"],
                          "'all-minilm-l6-v2' is a sentence encoder, not a text generator")


def test_a_hub_name_says_there_is_no_hub(capsys):
    assert_one_line_error(capsys, ["generate", "--model", "mlx-community/SmolLM2-135M-Instruct-8bit", "x"],
                          "looks like a Hugging Face Hub name")


def test_convert_writes_a_directory_the_usual_mlx_lm_command_runs(capsys, tmp_path):
    model = tiny_gguf(tmp_path / "tiny.gguf")
    assert cli_main(["convert", "--model", model, "--mlx-path", str(tmp_path / "mlx")]) == 0
    capsys.readouterr()
    outputs = []
    for source in (model, str(tmp_path / "mlx")):
        assert cli_main(["generate", "--model", source, "--prompt", "the then", "--max-tokens", "5"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()
    assert_one_line_error(capsys, ["convert", "--model", model, "--mlx-path", str(tmp_path / "mlx")],
                          "already exists and is not an empty directory")


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
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--seed", str(2**64)], "--seed must be <="),
    (["--temp", "nan"], "--temp must be finite, got nan"),
    (["--temp", "inf"], "--temp must be finite"),
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--top-p", "2"], "--top-p must be <= 1.0"),
    (["--top-k", "-3"], "--top-k must be >= 0"),
    (["--min-p", "nan"], "--min-p must be finite"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--max-tokens", "-5"], "--max-tokens must be >= 0, got -5"),
    (["--prefill-chunk", "0"], "--prefill-step-size/--prefill-chunk must be >= 1"),
    (["--prefill-step-size", "-1"], "--prefill-step-size/--prefill-chunk must be >= 1, got -1"),
    (["--max-kv-size", "2"], "--max-kv-size must be at least 5, got 2: the rotating KV cache always keeps the first 4 tokens (attention sinks)"),
    (["--verbose", "maybe"], "argument --verbose: expected True or False"),
    (["--prompt", "Hi"], "either positionally or with --prompt"),
    (["--chat", "--ignore-chat-template"], "contradict each other"),
    (["--extra-eos-token", "<|no-such-token|>"], "end token '<|no-such-token|>' is not in the vocabulary"),
    (["--ignore-chat-template", "--system-prompt", "Be brief."], "--system-prompt needs the model's chat template"),
    (["--max-tokens", "abc"], "argument --max-tokens/-m: invalid int value: 'abc'"),
    (["--seed", "1.5"], "argument --seed: invalid int value"),
    (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--model", ""], "empty string"),
    (["--model", "no-such-model"], "'no-such-model' not found"),
    (["--system", "caf\udce9", "--chat"], "--system-prompt is not valid UTF-8"),
])
def test_option_mistakes(capsys, options, message):
    captured = assert_one_line_error(capsys, ["generate", "Hello", *options], message)
    assert captured.out == ""  # nothing generated, not even the prompt echoed


def test_missing_command(capsys):
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
