"""The CPU benchmark script runs end to end (a smoke run, not a timing test)."""

import importlib.util
import json
from pathlib import Path

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
