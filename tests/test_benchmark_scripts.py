"""The CPU benchmark script runs end to end (a smoke run, not a timing test)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_sdpa_cpu.py"


def test_cpu_benchmark_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_sdpa_cpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_sdpa_cpu.json").read_text())
    assert (tmp_path / "bench_sdpa_cpu.png").stat().st_size > 10_000
    assert len(saved["rows"]) == len(result["rows"]) == 4
    for row in saved["rows"]:
        assert row["fused"]["gflops"] > 0 and row["mx.fast"]["gflops"] > 0
    # FLOP count: causal counts the visible pairs only
    assert bench.attention_flops(1, 1, 4, 4, 8, 8, True) == 2 * 10 * 16
    assert bench.attention_flops(1, 1, 4, 4, 8, 8, False) == 2 * 16 * 16


def _load_cpu_bench():
    spec = importlib.util.spec_from_file_location("bench_sdpa_cpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_cpu_benchmark_contention_rounds_pair_quiet_and_busy_timings():
    import time

    bench = _load_cpu_bench()
    # stand-ins: "torch" sleeps six times as long as "fused" (a sleep only overshoots, by load)
    timed = {"fused": lambda: time.sleep(0.01), "torch": lambda: time.sleep(0.06)}
    c = bench.contention_ratios(timed, rounds=3, repeats=1)
    assert len(c["quiet_ratios"]) == len(c["busy_ratios"]) == 3
    for ratio in c["quiet_ratios"] + c["busy_ratios"]:
        assert ratio > 1  # torch time over fused time, not its inverse (~0.17)
    assert abs(c["change"] - (c["busy_median"] / c["quiet_median"] - 1)) < 1e-12
    row = {"D": 64, "dtype": "float32", "causal": False, "T": 8,
           "fused": {"ms": 1.0, "gflops": 2.0, "extra_peak_mib": 0.0}, "torch": {"ms": 3.0, "gflops": 0.7},
           "contention": {**c, "quiet_median": 3.0, "busy_median": 2.7, "change": -0.1}}
    table = bench.summary_table([row])
    assert "change under load" in table.splitlines()[0]
    assert table.splitlines()[2].endswith("| 3.00x | 2.70x | -10% |")


def test_cpu_benchmark_refuses_busy_with_contention(capsys):
    import pytest

    bench = _load_cpu_bench()
    with pytest.raises(SystemExit):
        bench.main(["--busy", "--contention", "2", "--quick"])
    assert "--busy and --contention" in capsys.readouterr().err


def test_generation_benchmark_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH.parent / "bench_generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick", "--out", str(tmp_path)])
    assert [r["context"] for r in rows] == [16, 32]
    for r in rows:
        for backend in ("fused", "reference"):
            assert r[backend]["generated"] == 3 and r[backend]["generation_tps"] > 0
    assert (tmp_path / "bench_generate.png").stat().st_size > 10_000


def test_paged_benchmark_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_paged", BENCH.parent / "bench_paged.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_paged.json").read_text())
    assert (tmp_path / "bench_paged.png").stat().st_size > 10_000
    cases = ["decode 16", "decode 64", "mixed"]
    assert [r["case"] for r in saved["rows"]] == [r["case"] for r in result["rows"]] == cases
    assert saved["metal_rows"] == bench.metal_rows(True)
    for row in saved["rows"]:
        assert row["path"] == "fused-cpu"
        for method in bench.METHODS:
            assert row[method]["ms"] > 0
            assert row[method]["max_abs_diff_vs_c"] < 1e-4  # every method computes the same rows
        # the fused path adds tiles, never a copy of the pages as gathering does
        assert row["fused paged"]["extra_mib"] < row["(b) gather"]["extra_mib"]



def test_cascade_benchmark_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_cascade", BENCH.parent / "bench_cascade.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_cascade.json").read_text())
    assert (tmp_path / "bench_cascade.png").stat().st_size > 10_000
    assert saved["rows"] == result["rows"] and [r["pages"] for r in saved["rows"]] == ["fp16", "4-bit"]
    for row in saved["rows"]:
        assert row["path"] == "cascade-cpu" and row["paged_ms"] > 0 and row["cascade_ms"] > 0
        assert row["max_abs_diff"] < 2e-3  # both compute the same rows (fp16 outputs)


def test_cascade_benchmark_metal_rows_are_modelled(capsys):
    """--metal: the modelled device bytes (no emulator run, no timing),
    labelled as modelled; the 16 x 4k row meets the issue's 0.15x."""
    spec = importlib.util.spec_from_file_location("bench_cascade", BENCH.parent / "bench_cascade.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--metal"])
    assert result["modelled"] and "MODELLED" in capsys.readouterr().out
    row = next(r for r in result["rows"] if (r["sequences"], r["prefix"], r["D"]) == (16, 4096, 64))
    assert row["cascade / paged"] <= 0.15
    assert all(r["cascade / paged"] < 1 for r in result["rows"])


def test_compile_benchmark_times_the_per_variant_sources_the_host_compiles():
    """benchmarks/bench_metal_compile.py times the sources the Mac host
    compiles on first use (_ext.metal_variant_source): each of its kernels
    is a per-variant kernel of its family, whose source ends with the one
    instantiation (the compile itself is what the benchmark times)."""
    import pytest

    from mlx_attn import _native

    if _native.ext is None:
        pytest.skip("the native extension is not built")
    spec = importlib.util.spec_from_file_location("bench_metal_compile", BENCH.parent / "bench_metal_compile.py")
    bench_metal_compile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_metal_compile)

    for family, kinds in bench_metal_compile.VARIANTS.items():
        for kind, kernel in kinds.items():
            assert kernel.startswith(family + "_")
            text = bench_metal_compile.one_variant_source(family, kind)
            last = text.rstrip().splitlines()[-1]
            assert last.startswith("MLX_ATTN_") and "float16, half, " in last, (kernel, last)


def test_decode_step_benchmark_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_decode_step", BENCH.parent / "bench_decode_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--models", "tiny", "--tokens", "12", "--repeats", "1", "--out", str(tmp_path / "decode")])
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert saved["rows"] == result["rows"] and [r["model"] for r in saved["rows"]] == ["tiny"]
    row = saved["rows"][0]
    for mode in ("off", "on"):
        assert row[mode]["ms_per_step"] > 0 and len(row[mode]["runs_ms"]) == 1
    assert row["same_tokens"] is True  # compiled and eager steps decode the same greedy tokens
    assert (tmp_path / "decode.png").stat().st_size > 10_000


def _load_llama_cpp_bench():
    spec = importlib.util.spec_from_file_location("bench_llama_cpp", BENCH.parent / "bench_llama_cpp.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _fake_mlx_attn(bench, monkeypatch):
    """No model: the prompt and mlx-attn generate's statistics stand in."""
    monkeypatch.setattr(bench, "prompt_of", lambda gguf, tokens: "x " * tokens)
    monkeypatch.setattr(bench, "run_mlx_attn", lambda gguf, prompt, gen, threads: {
        "prompt_tokens": 128, "prompt_tps": 50.0, "gen_tokens": gen, "gen_tps": 20.0})


def test_llama_cpp_benchmark_skips_llama_cpp_rows_without_its_binaries(tmp_path, monkeypatch, capsys):
    bench = _load_llama_cpp_bench()
    _fake_mlx_attn(bench, monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    result = bench.main(["--gguf", str(tmp_path / "m.gguf"), "--llama-cpp-dir", str(tmp_path), "--repeats", "1",
                         "--threads", "2", "--out", str(tmp_path / "llama"), "--rows", "generate"])
    out = capsys.readouterr().out
    assert "llama.cpp rows skipped: no llama-bench found" in out
    assert "| prompt tokens/s (`llama-bench` pp128) | 50.0 | skipped | - |" in out
    assert "llama_cpp" not in result and result["mlx_attn"] == {"prompt_tps": 50.0, "gen_tps": 20.0}
    assert (tmp_path / "llama.png").stat().st_size > 5_000


def test_llama_cpp_benchmark_reads_llama_bench_json(tmp_path, monkeypatch, capsys):
    """A stand-in llama-bench (a script printing llama-bench's JSON rows and
    its arguments): the table's ratios are mlx_attn over llama.cpp, at the
    same threads and token counts."""
    bench = _load_llama_cpp_bench()
    _fake_mlx_attn(bench, monkeypatch)
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\n"
                    "echo '[{\"n_prompt\": 128, \"n_gen\": 0, \"avg_ts\": 200.0},"
                    " {\"n_prompt\": 0, \"n_gen\": 64, \"avg_ts\": 80.0}]'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))  # found under its bin/
    result = bench.main(["--gguf", str(tmp_path / "m.gguf"), "--repeats", "2", "--threads", "3", "--rows", "generate"])
    assert (fake.parent / "args").read_text().split() == ["-m", str(tmp_path / "m.gguf"), "-t", "3", "-p", "128",
                                                          "-n", "64", "-r", "1", "-o", "json"]
    assert result["llama_cpp"] == {"prompt_tps": 200.0, "gen_tps": 80.0}
    assert result["ratio"] == {"prompt_tps": 0.25, "gen_tps": 0.25}
    assert "| decode tokens/s (`llama-bench` tg64) | 20.0 | 80.0 | 0.25x |" in capsys.readouterr().out


def _fake_servers(monkeypatch, peak_memory: dict):
    """kernel_lab.serving_load without processes: each Server records its
    command and environment, each load phase answers per server."""
    import kernel_lab.serving_load as serving_load

    started = {}

    class FakeServer:
        def __init__(self, name, command, port, log, cwd=None, env=None):
            self.name, self.stopped = name, False
            started[name] = (command, env, self)

        def peak_memory(self):
            return peak_memory[self.name]

        def stop(self):
            self.stopped = True

    ports = iter(range(9000, 9100))
    monkeypatch.setattr(serving_load, "Server", FakeServer)
    monkeypatch.setattr(serving_load, "free_port", lambda: next(ports))
    mine = lambda port: started["mlx-attn serve"][0][-1] == str(port)
    monkeypatch.setattr(serving_load, "load_phase", lambda port, c, n, max_tokens: {
        "concurrency": c, "requests": n, "max_tokens": max_tokens, "tokens": n * max_tokens, "seconds": 1.0,
        "tokens_per_s": (10.0 if mine(port) else 40.0) * c, "ttft_p50": 0.5 if mine(port) else 0.25,
        "ttft_p95": 1.0 if mine(port) else 0.5})
    return started


def test_llama_cpp_benchmark_serve_rows(tmp_path, monkeypatch, capsys):
    """Serve rows: both servers on 127.0.0.1 with the same GGUF and threads
    (llama-server with 16 slots), every level on each, ratios mlx_attn over
    llama.cpp, peak memory per server, both servers stopped."""
    bench = _load_llama_cpp_bench()
    server_binary = tmp_path / "bin" / "llama-server"
    server_binary.parent.mkdir()
    server_binary.write_text("#!/bin/sh\n")
    server_binary.chmod(0o755)
    started = _fake_servers(monkeypatch, {"mlx-attn serve": 300 * 2**20, "llama-server -np 16": 100 * 2**20})
    gguf = tmp_path / "m.gguf"
    result = bench.main(["--gguf", str(gguf), "--llama-cpp-dir", str(tmp_path), "--threads", "3", "--rows", "serve",
                         "--requests", "2", "4", "8", "--max-tokens", "5", "--out", str(tmp_path / "serve")])
    ours, _, our_server = started["mlx-attn serve"]
    theirs, their_env, their_server = started["llama-server -np 16"]
    assert ours[ours.index("--model") + 1] == str(gguf) and started["mlx-attn serve"][1] == {"MLX_ATTN_NUM_THREADS": "3"}
    assert [theirs[theirs.index(flag) + 1] for flag in ("-m", "-t", "-np", "--host")] == [str(gguf), "3", "16",
                                                                                          "127.0.0.1"]
    assert our_server.stopped and their_server.stopped
    serve = result["serve"]
    assert [p["concurrency"] for p in serve["mlx_attn"]["load"]] == [1, 4, 16] == \
        [p["concurrency"] for p in serve["llama_cpp"]["load"]]
    assert [p["requests"] for p in serve["llama_cpp"]["load"]] == [2, 4, 8]
    out = capsys.readouterr().out
    assert "| serve c16: aggregate tokens/s (8 requests x 5 tokens) | 160.0 | 640.0 | 0.25x |" in out
    assert "| serve c4: TTFT p50 (s) | 0.50 | 0.25 | 2.00x |" in out
    assert "| serve: server peak resident memory (MiB) | 300 | 100 | 3.00x |" in out
    assert (tmp_path / "serve.png").stat().st_size > 5_000


def test_llama_cpp_benchmark_skips_llama_server_rows_without_it(tmp_path, monkeypatch, capsys):
    bench = _load_llama_cpp_bench()
    started = _fake_servers(monkeypatch, {"mlx-attn serve": None})
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    result = bench.main(["--gguf", str(tmp_path / "m.gguf"), "--llama-cpp-dir", str(tmp_path), "--rows", "serve",
                         "--requests", "1", "1", "1"])
    out = capsys.readouterr().out
    assert "llama.cpp serve rows skipped: no llama-server found" in out
    assert list(started) == ["mlx-attn serve"] and "llama_cpp" not in result["serve"]
    assert "| serve c1: aggregate tokens/s (1 requests x 48 tokens) | 10.0 | skipped | - |" in out
    assert "| serve: server peak resident memory (MiB) | - | skipped | - |" in out


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_speculative_benchmark_quick_run(tmp_path, model):
    """Every phase on a tiny random model; on the default model (minutes on
    2 cores) with MLX_ATTN_FULL_GRID=1."""
    if model == "default" and os.environ.get("MLX_ATTN_FULL_GRID") != "1":
        pytest.skip("the default model's smoke run takes minutes here: MLX_ATTN_FULL_GRID=1 runs it")
    spec = importlib.util.spec_from_file_location("bench_speculative", BENCH.parent / "bench_speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    loaded = None
    if model == "tiny":
        from model_fixtures import random_llama, tiny_tokenizer, tiny_vocabulary

        loaded = (random_llama(seed=1, vocab_size=len(tiny_vocabulary()[0]), max_position_embeddings=8192),
                  tiny_tokenizer())
    result = bench.main(["--quick", "--out", str(tmp_path / "spec")], loaded=loaded)
    saved = json.loads((tmp_path / "spec.json").read_text())
    engine_phases = {f"{w}-c{c}" for w in ("edit", "chat") for c in (1, 4, 16)}
    assert set(saved["phases"]) == engine_phases | {f"{p}-draft" for p in engine_phases} | {
        "generate-edit", "generate-chat", "generate-edit-draft", "generate-chat-draft"}
    assert saved["phases"]["generate-chat-draft"]["on"]["draft_tokens"] > 0  # the draft model proposed
    for pair in saved["phases"].values():
        assert pair["identical"] is True  # greedy outputs with and without drafts
        assert pair["off"]["draft_tokens"] == 0 and pair["on"]["generated"] > 0
    assert sum(pair["on"]["draft_tokens"] for pair in saved["phases"].values()) > 0
    assert [r["rows"] for r in result["rows"]] == [1, 2]
    assert (tmp_path / "spec.png").stat().st_size > 10_000


def test_speculative_benchmark_prompts_a_base_model_as_a_completion():
    """A model without a chat template (a base model, Gemma 3 270M's GGUF)
    gets the edit as plain text ending in the opening of the changed file;
    a chat model gets the request as a user turn."""
    spec = importlib.util.spec_from_file_location("bench_speculative", BENCH.parent / "bench_speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Tokenizer:
        def __init__(self, chat_template):
            self.chat_template, self.encoded = chat_template, []

        def apply_chat_template(self, messages):
            return f"<user>{messages[0]['content']}</user>"

        def encode(self, text, add_special_tokens=True):
            self.encoded.append((text, add_special_tokens))
            return [len(text)]

    text = "def alpha(x):\n    return x\n\n\ndef beta():\n    return alpha(1)\n"
    base, chat = Tokenizer(None), Tokenizer("{{ messages }}")
    bench.edit_prompts(base, text, 2)
    bench.edit_prompts(chat, text, 2)
    (first, special), (second, _) = base.encoded
    assert special and first.startswith("Here is a Python file:") and first.endswith("```python\n")
    assert "`alpha` renamed to `alpha_v2`" in first and "`beta` renamed to `beta_v3`" in second
    (turn, special), _ = chat.encoded
    assert not special and turn.startswith("<user>") and "Reply with the whole file only." in turn
    bench.chat_prompts(base, 1)
    assert base.encoded[-1][0].startswith("Question: ") and base.encoded[-1][0].endswith("\nAnswer:")


def test_serve_benchmark_cascade_table():
    """bench_serve.py --cascade's table: medians of the rounds, on / off."""
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH.parent / "bench_serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rounds = {"on": [{"tokens_per_s": 12.0, "ttft_p50": 2.0, "ttft_p95": 3.0},
                     {"tokens_per_s": 20.0, "ttft_p50": 1.0, "ttft_p95": 1.5}],
              "off": [{"tokens_per_s": 8.0, "ttft_p50": 4.0, "ttft_p95": 4.0},
                      {"tokens_per_s": 8.0, "ttft_p50": 2.0, "ttft_p95": 4.0}]}
    table = bench.cascade_table(rounds, 4105, 16, 32)
    assert "c16, 4105-token shared system prompt, 32 tokens each" in table
    assert "| aggregate tokens/s (median of 2 rounds) | 16.0 | 8.0 | 2.00x |" in table
    assert "| TTFT p50 (s) (median of 2 rounds) | 1.50 | 3.00 | 0.50x |" in table
    assert "c16, no system prompt, 32 tokens each" in bench.cascade_table(rounds, 0, 16, 32)


def test_serve_benchmark_cascade_rounds_without_servers(monkeypatch, tmp_path):
    """bench_serve.py --cascade's rounds over stand-in servers and chats: each
    round times its 16 concurrent chats, and both servers start outside the
    checkout (there ``python -m`` imports the installed package, with _ext)."""
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH.parent / "bench_serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    started = []

    class StandIn:
        def __init__(self, name, command, port, log, cwd=None, env=None):
            started.append((command, cwd))

        def stop(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stop()

    chats = []
    monkeypatch.setattr(bench, "Server", StandIn)
    monkeypatch.setattr(bench, "chat", lambda port, messages, n: chats.append(messages) or {"ttft": 0.5, "tokens": n})

    class Args:
        max_tokens, serve_args, cascade_rounds, cascade_concurrency = 8, "", 2, 16

    results = bench.cascade_comparison(tmp_path, "shared", Args, tmp_path)
    assert [c[1] for c in started] == [tmp_path, tmp_path]
    assert sorted(c[0][c[0].index("--cascade") + 1] for c in started) == ["off", "on"]
    assert len(chats) == 2 + 2 * 2 * 16  # one priming chat a server, then the rounds
    for side in ("on", "off"):
        assert len(results[side]) == 2
        assert all(r["tokens"] == 16 * 8 and r["ttft_p50"] == 0.5 for r in results[side])
