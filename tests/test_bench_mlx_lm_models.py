"""The pieces of benchmarks/bench_mlx_lm_models.py its --quick run relies on
(not a timing test): the checkpoint writer's output loads through mlx-lm and
through mlx_attn, the prompts are the token counts they claim, the CLIs'
statistics lines parse, and the table compares against the issue's targets."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="the benchmark writes its checkpoints with mlx-lm's classes")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_mlx_lm_models.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_mlx_lm_models", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quick_qwen3_checkpoint_loads_and_never_ends_early(bench, tmp_path):
    import mlx.core as mx

    from mlx_attn.lm import mlx_lm_models
    from mlx_attn.lm.generate import GenerationConfig, generate_step

    directory = bench.checkpoint(tmp_path, "qwen3", bench.QUICK_SHAPES["qwen3"])
    assert bench.checkpoint(tmp_path, "qwen3", bench.QUICK_SHAPES["qwen3"]) == directory  # written once
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["eos_token_id"] == bench.SPECIALS.index(bench.EOS)
    assert bench.parameter_count(directory) > config["vocab_size"] * config["hidden_size"]
    try:
        model, tokenizer = mlx_lm_models.load(directory)
        ids = tokenizer.encode(bench.prompt_text(40))
        assert len(ids) == 40 and tokenizer.vocab_size == config["vocab_size"]
        assert "<unk>" not in tokenizer.decode(ids)  # every prompt word is in the vocabulary
        chat = tokenizer.apply_chat_template([{"role": "user", "content": bench.QUESTIONS[0]}])
        assert tokenizer.decode(tokenizer.encode(chat)).startswith("user : Explain how")
        tokens = [t for t, _ in generate_step(model, ids, GenerationConfig(max_tokens=12))]
        assert len(tokens) == 12 and bench.SPECIALS.index(bench.EOS) not in tokens
        assert mx.all(model.model.model.embed_tokens(mx.array([2])) == 0).item()  # EOS's tied output row
    finally:
        mlx_lm_models.restore_attention()


def test_statistics_lines_parse_and_the_table_names_targets(bench):
    output = ("text\n==========\nPrompt: 128 tokens, 250.500 tokens-per-sec\n"
              "Generation: 64 tokens, 20.250 tokens-per-sec\nPeak memory: 0.321 GB\n")
    assert bench.parse_statistics(output) == {"prompt_tokens": 128, "prompt_tps": 250.5, "generation_tokens": 64,
                                              "generation_tps": 20.25, "peak_memory_gb": 0.321}
    with pytest.raises(RuntimeError, match="no statistics"):
        bench.parse_statistics("Traceback ...")

    def side(decode):
        return {"prompt_tps": 100.0, "generation_tps": decode, "generation_tokens": 64}

    def load(c, tps, ttft):
        return {"concurrency": c, "requests": 16, "max_tokens": 32, "tokens_per_s": tps, "ttft_p50": ttft,
                "ttft_p95": ttft * 2}

    results = {"models": {
        "qwen3": {"generate": {"128": {"mlx_attn": side(22.0), "mlx_lm": side(20.0)},
                               "2048": {"mlx_attn": side(11.0), "mlx_lm": side(10.0)}},
                  "serve": {"mlx_attn": [load(16, 60.0, 1.0)], "mlx_lm": [load(16, 10.0, 5.0)]},
                  "memory": {"float16": 1000, "4-bit": 280, "tokens": 2112, "layers": 8,
                             "full_attention_layers": 8}},
        "gemma3_text": {"generate": {"2048": {"mlx_attn": side(5.0), "mlx_lm": side(4.0)}}}}}
    lines = bench.table(results).splitlines()
    decode_128 = next(line for line in lines if "128-token prompt: decode" in line)
    assert "| 1.10x | >= 1.0x | yes |" in decode_128
    assert "| 1.10x | >= 1.2x | NO |" in next(line for line in lines if "2048-token prompt: decode" in line)
    assert "| 6.00x | >= 5.0x | yes |" in next(line for line in lines if "c16: aggregate" in line)
    assert "| 0.20x | <= 0.3x | yes |" in next(line for line in lines if "c16: TTFT p50" in line)
    assert "| 0.28x | <= 0.35x | yes |" in next(line for line in lines if "4-bit / float16" in line)
    gemma = next(line for line in lines if line.startswith("| gemma3_text") and "decode" in line)
    assert gemma.endswith("| 1.25x |  |  |")  # no target for the window rows
