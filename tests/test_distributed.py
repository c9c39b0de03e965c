"""Ring attention: single-process pieces, then real ranks on 127.0.0.1.

Multi-rank tests start 2 and 3 processes with ``mlx.launch --backend ring``
(or by hand with a hostfile where the launcher would hide what the survivors
do) and batch many cases into one launch; every launch is bounded by a
subprocess timeout.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_attn
from mlx_attn import distributed as dist
from kernel_lab.local_ranks import LOCALHOST, free_port_base, ring_command, run_ranks

WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCH_TIMEOUT_S = 120
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


# --------------------------------------------------------------------------
# single process


def _random(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _full_lse(q, k, scale, visible=None):
    scores = (q @ k.swapaxes(-1, -2)) * scale
    if visible is not None:
        scores = mx.where(visible, scores, -mx.inf)
    return mx.logsumexp(scores, axis=-1)


def test_merge_partials_equals_attention_over_the_union(block_path):
    q, k, v = _random((1, 2, 5, 4), 0), _random((1, 2, 9, 4), 1), _random((1, 2, 9, 3), 2)
    scale = 0.5
    expected = mlx_attn.reference_attention(q, k, v, scale=scale)
    first = dist._attend_block(q, k[:, :, :4], v[:, :, :4], scale=scale)
    second = dist._attend_block(q, k[:, :, 4:], v[:, :, 4:], scale=scale)
    out, lse = dist.merge_partials(*first, *second)
    assert mx.allclose(out, expected, atol=1e-5).item()
    assert mx.allclose(lse, _full_lse(q, k, scale), atol=1e-5).item()
    # the merge is symmetric
    out_swapped, _ = dist.merge_partials(*second, *first)
    assert mx.allclose(out_swapped, out, atol=1e-6).item()


def test_merge_partials_handles_rows_that_see_nothing():
    out = mx.array([[[1.0, 2.0], [3.0, 4.0]]])
    lse = mx.array([[0.5, -mx.inf]])
    empty_out, empty_lse = mx.zeros_like(out), mx.full(lse.shape, -mx.inf)
    merged, merged_lse = dist.merge_partials(out, lse, empty_out, empty_lse)
    assert mx.array_equal(merged, mx.array([[[1.0, 2.0], [0.0, 0.0]]])).item()
    assert merged_lse[0, 0].item() == pytest.approx(0.5)
    assert merged_lse[0, 1].item() == -math.inf
    both, both_lse = dist.merge_partials(empty_out, empty_lse, empty_out, empty_lse)
    assert not mx.any(mx.isnan(both)).item() and mx.all(both == 0).item()
    assert mx.all(both_lse == -mx.inf).item()


@pytest.fixture(params=["fused", "reference"])
def block_path(request, monkeypatch):
    """Runs a test with blocks on the fused kernel and again on the reference
    path (which materializes scores, so ring attention tiles the queries)."""
    if request.param == "reference":
        monkeypatch.setattr(dist, "_BLOCK_BACKEND", "reference")
        monkeypatch.setattr(dist, "_REFERENCE_QUERY_TILE", 4)
    tiny = mx.zeros((1, 1, 2, 4))
    assert dist._scores_materialized(tiny, tiny, tiny) == (request.param == "reference")
    return request.param


def test_attend_block_lse_of_an_empty_row_is_minus_infinity(block_path):
    q, k, v = _random((1, 1, 3, 4), 3), _random((1, 1, 3, 4), 4), _random((1, 1, 3, 4), 5)
    nothing_for_row_0 = mx.array([[False, False, False], [True, False, False], [True, True, True]])
    out, lse = dist._attend_block(q, k, v, scale=1.0, mask=nothing_for_row_0)
    assert lse[0, 0, 0].item() == -math.inf and mx.all(out[0, 0, 0] == 0).item()
    assert mx.allclose(lse[0, 0, 1:], _full_lse(q, k, 1.0, nothing_for_row_0)[0, 0, 1:], atol=1e-5).item()


@pytest.mark.parametrize("window", [None, 2])
def test_attend_block_causal_matches_scaled_dot_product_attention(block_path, window):
    q, k, v = _random((1, 4, 6, 8), 15), _random((1, 2, 6, 8), 16), _random((1, 2, 6, 8), 17)
    out, lse = dist._attend_block(q, k, v, scale=0.4, mask="causal", window_size=window)
    expected = mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.4, mask="causal", window_size=window)
    visible = mlx_attn.reference.causal_visibility(6, 6, window)
    k_repeated = mx.repeat(k, 2, axis=1)
    assert mx.allclose(out, expected, atol=1e-5).item()
    assert mx.allclose(lse, _full_lse(q, k_repeated, 0.4, visible), atol=1e-5).item()


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(ranks):
    seq_len = 2 * ranks * 64
    zigzag = dist.attention_work(seq_len, ranks, layout="zigzag")
    contiguous = dist.attention_work(seq_len, ranks, layout="contiguous")
    causal_pairs = seq_len * (seq_len + 1) // 2
    assert sum(zigzag) == sum(contiguous) == causal_pairs
    assert max(zigzag) <= 1.1 * (sum(zigzag) / ranks)
    assert max(contiguous) > 1.25 * (sum(contiguous) / ranks)
    # a window makes every position's work equal but the first window's: balanced when it is short
    windowed = dist.attention_work(16 * seq_len, ranks, layout="zigzag", window_size=100)
    assert max(windowed) <= 1.1 * (sum(windowed) / ranks)


def test_attention_work_counts_window_pairs():
    # 8 positions, window 3: query p sees min(p + 1, 3) keys.
    assert sum(dist.attention_work(8, 2, layout="contiguous", window_size=3)) == 1 + 2 + 3 * 6
    assert dist.attention_work(8, 2, layout="contiguous", causal=False) == [32, 32]


@pytest.mark.parametrize("layout", dist.LAYOUTS)
@pytest.mark.parametrize("mask,window", [(None, None), ("causal", None), ("causal", 3), (None, 5)])
def test_one_rank_equals_scaled_dot_product_attention(layout, mask, window, block_path):
    q, k, v = _random((2, 4, 16, 8), 6), _random((2, 2, 16, 8), 7), _random((2, 2, 16, 8), 8)
    sinks = _random((4,), 9)
    stats = dist.RingStats()
    out = dist.ring_attention(
        q, k, v, scale=0.3, mask=mask, sinks=sinks, window_size=window, layout=layout, stats=stats
    )
    expected = mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=sinks, window_size=window)
    assert mx.allclose(out, expected, atol=1e-5).item()
    assert stats.bytes_sent == 0 and stats.ring_steps == 1
    causal = mask == "causal" or window is not None
    assert stats.visible_pairs == dist.attention_work(16, 1, layout=layout, causal=causal, window_size=window)[0]


RING_PEAK_MEMORY = """
import json
import mlx.core as mx
import mlx_attn
from mlx_attn import distributed as dist
mx.random.seed(0)
q, k, v = mx.random.normal((1, 4, 8192, 32)), mx.random.normal((1, 1, 8192, 32)), mx.random.normal((1, 1, 8192, 32))
mx.eval(q, k, v)
mx.reset_peak_memory()
out = dist.ring_attention(q, k, v, scale=32**-0.5, mask="causal")
mx.eval(out)
beyond_inputs = mx.get_peak_memory() - (q.nbytes + k.nbytes + v.nbytes)
same = mx.allclose(out, mlx_attn.scaled_dot_product_attention(q, k, v, scale=32**-0.5, mask="causal"), atol=1e-5)
print(json.dumps({"beyond_inputs": beyond_inputs, "out_bytes": out.nbytes, "same": same.item()}))
"""


def test_ring_attention_accumulates_the_output_in_place():
    # beyond its inputs a rank holds the float32 output and a few query tiles, never a second output-sized
    # array; measured in a fresh process so nothing else in the test session shares MLX's peak counter
    done = subprocess.run([sys.executable, "-c", RING_PEAK_MEMORY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["same"]
    assert report["beyond_inputs"] <= 1.3 * report["out_bytes"], report


def test_one_rank_shard_and_unshard_are_identities():
    x = _random((1, 2, 8, 3), 10)
    assert mx.array_equal(dist.shard_sequence(x), x).item()
    assert mx.array_equal(dist.unshard_sequence(x), x).item()


def test_bad_arguments_raise_clear_value_errors():
    q = _random((1, 2, 8, 4), 11)
    with pytest.raises(ValueError, match="array masks are not supported"):
        dist.ring_attention(q, q, q, scale=1.0, mask=mx.ones((8, 8), dtype=mx.bool_))
    with pytest.raises(ValueError, match="layout must be one of"):
        dist.ring_attention(q, q, q, scale=1.0, layout="striped")
    with pytest.raises(ValueError, match="same length"):
        dist.ring_attention(q, q[:, :, :4], q[:, :, :4], scale=1.0, mask="causal")
    with pytest.raises(ValueError, match="divisible by 2"):
        dist.ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], scale=1.0, mask="causal")
    with pytest.raises(ValueError, match="scale"):
        dist.ring_attention(q, q, q, scale=float("nan"))
    with pytest.raises(ValueError, match="group"):
        dist.ring_attention(q, q, q, scale=1.0, group="world")
    with pytest.raises(ValueError, match="stats"):
        dist.ring_attention(q, q, q, scale=1.0, stats={})
    with pytest.raises(ValueError, match="divisible by 2"):
        dist.shard_sequence(q[:, :, :7])
    with pytest.raises(ValueError, match="axis"):
        dist.shard_sequence(q, axis=4)
    with pytest.raises(ValueError, match="timeout"):
        dist.init(timeout=0)


def test_non_causal_shards_may_differ_in_length():
    q, k, v = _random((1, 2, 6, 4), 12), _random((1, 2, 10, 4), 13), _random((1, 2, 10, 4), 14)
    expected = mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert mx.allclose(dist.ring_attention(q, k, v, scale=0.5), expected, atol=1e-5).item()


def test_timeout_environment_variable_is_checked(monkeypatch):
    monkeypatch.setenv(dist.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=dist.TIMEOUT_ENV):
        dist._timeout_seconds(None)
    monkeypatch.setenv(dist.TIMEOUT_ENV, "2.5")
    assert dist._timeout_seconds(None) == 2.5
    assert dist._timeout_seconds(7) == 7.0


# --------------------------------------------------------------------------
# real ranks


def _launch(ranks: int, mode: str, out_dir: Path, *extra: str, timeout_s: float = LAUNCH_TIMEOUT_S):
    return run_ranks(ranks, [sys.executable, str(WORKER), mode, str(out_dir), *extra], out_dir, timeout_s=timeout_s)


def _cases():
    cases, seed = [], 0
    for layout in dist.LAYOUTS:
        for mask, window, sinks in [(None, None, False), ("causal", None, False), ("causal", 5, False),
                                    (None, 13, True), ("causal", None, True)]:
            for dtype, (q_heads, kv_heads) in [("float32", (4, 2)), ("float16", (2, 1)), ("bfloat16", (2, 2))]:
                seed += 1
                cases.append({"seed": seed, "seq": 72, "head_dim": 8, "q_heads": q_heads, "kv_heads": kv_heads,
                              "batch": 1 + seed % 2, "dtype": dtype, "layout": layout, "mask": mask,
                              "window": window, "sinks": sinks})
        # K/V travelling in several pieces per chunk (the default keeps a chunk this short whole)
        for mask, window, sinks in [("causal", None, False), ("causal", 5, True), (None, None, False)]:
            seed += 1
            cases.append({"seed": seed, "seq": 72, "head_dim": 8, "q_heads": 4, "kv_heads": 2, "batch": 1,
                          "dtype": "float32", "layout": layout, "mask": mask, "window": window, "sinks": sinks,
                          "min_piece": 2})
    return cases


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def ring_results(request, tmp_path_factory):
    ranks = request.param
    out_dir = tmp_path_factory.mktemp(f"ring{ranks}")
    cases_file = out_dir / "cases.json"
    cases_file.write_text(json.dumps(_cases()))
    return ranks, _launch(ranks, "compare", out_dir, str(cases_file))


def test_ring_attention_matches_single_process_attention(ring_results):
    ranks, per_rank = ring_results
    assert len(per_rank[0]) == len(_cases())
    for rank, results in enumerate(per_rank):
        for result in results:
            case = result["case"]
            label = f"rank {rank}/{ranks}: {case}"
            assert result["finite"], label
            assert result["max_abs_error"] <= TOLERANCE[case["dtype"]], label
            assert result["out_dtype"] == f"mlx.core.{case['dtype']}", label
            assert result["shard_matches"], label
            if case["mask"] is None and case["window"] is None:
                assert result["ring_steps"] == ranks, label  # its own block, then every other rank's


def test_each_rank_does_exactly_its_layout_work(ring_results):
    ranks, per_rank = ring_results
    for rank, results in enumerate(per_rank):
        for result in results:
            case = result["case"]
            causal = case["mask"] == "causal" or case["window"] is not None
            work = dist.attention_work(case["seq"], ranks, layout=case["layout"], causal=causal,
                                       window_size=case["window"])
            pairs_per_head = result["visible_pairs"]
            assert pairs_per_head == work[rank], f"rank {rank}: {case}"


def test_bytes_sent_stay_within_the_ring_lower_bound(ring_results):
    ranks, per_rank = ring_results
    for index, case in enumerate(_cases()):
        sent = [results[index]["bytes_sent"] for results in per_rank]
        received = [results[index]["bytes_received"] for results in per_rank]
        shard_kv = per_rank[0][index]["shard_kv_bytes"]
        lower_bound = (ranks - 1) * shard_kv  # (n-1)/n of all K/V bytes
        assert sum(sent) == sum(received), case
        assert max(sent) <= 1.1 * lower_bound, case
        if case["mask"] is None and case["window"] is None:
            assert sent == [lower_bound] * ranks, case  # everyone needs every block
        if case["window"] is not None and case["window"] < case["seq"] // (2 * ranks):
            assert sum(sent) < ranks * lower_bound, f"window blocks were sent: {case}"


def test_mismatched_shapes_and_layouts_are_reported_on_every_rank(tmp_path):
    per_rank = _launch(2, "mismatch", tmp_path)
    for rank, errors in enumerate(per_rank):
        assert errors["shape"] is not None and "differ across ranks" in errors["shape"], rank
        assert errors["layout"] is not None and "differ across ranks" in errors["layout"], rank


# ----- failures: ranks started by hand so that no launcher hides the survivors' behaviour


def _start_by_hand(ranks: int, mode: str, out_dir: Path, *, only=None, timeout_s: float = 5.0):
    base = free_port_base(ranks)
    hostfile = out_dir / "hosts.json"
    hostfile.write_text(json.dumps([[f"{LOCALHOST}:{base + r}"] for r in range(ranks)]))
    processes = {}
    for rank in only if only is not None else range(ranks):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile),
                   **{dist.TIMEOUT_ENV: str(timeout_s)})
        processes[rank] = subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(out_dir)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    return processes


def _finish(processes, ranks, deadline_s):
    """(returncode, stderr, seconds) for each rank in ``ranks``; kills every process afterwards."""
    start, outcome = time.monotonic(), {}
    try:
        for rank in ranks:
            remaining = max(0.1, deadline_s - (time.monotonic() - start))
            try:
                _, stderr = processes[rank].communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still running after {deadline_s} s: it hangs")
            outcome[rank] = (processes[rank].returncode, stderr, time.monotonic() - start)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()
    return outcome


def test_a_rank_that_dies_makes_the_others_fail_fast_with_a_clear_error(tmp_path):
    processes = _start_by_hand(3, "die", tmp_path, timeout_s=60)
    outcome = _finish(processes, [1, 0, 2], deadline_s=30)
    assert outcome[1][0] == -signal.SIGKILL
    for rank in (0, 2):
        code, stderr, seconds = outcome[rank]
        assert code != 0, stderr
        assert "DistributedError" in stderr and "a peer died or disconnected" in stderr, stderr
        assert seconds < 30


def test_a_peer_that_hangs_trips_the_watchdog(tmp_path):
    processes = _start_by_hand(2, "hang", tmp_path, timeout_s=3)
    outcome = _finish(processes, [0], deadline_s=40)
    code, stderr, _ = outcome[0]
    assert code == dist.WATCHDOG_EXIT_CODE, stderr
    assert "did not finish within 3 s" in stderr and "rank 0" in stderr, stderr
    assert not (tmp_path / "rank0.json").read_text().count("finished")


def test_a_peer_that_never_connects_trips_the_watchdog(tmp_path):
    processes = _start_by_hand(2, "connect", tmp_path, only=[0], timeout_s=3)
    outcome = _finish(processes, [0], deadline_s=40)
    code, stderr, _ = outcome[0]
    assert code == -signal.SIGTERM, stderr
    assert "connecting the 'ring' group did not finish within 3 s" in stderr, stderr
    assert not (tmp_path / "rank0.json").exists()


# --------------------------------------------------------------------------
# distributed generation


def test_decode_attention_across_ranks_equals_attention_over_the_whole_cache(tmp_path):
    per_rank = _launch(2, "decode", tmp_path)
    assert len(per_rank[0]) == 4
    for index, result in enumerate(per_rank[0]):
        case = result["case"]
        assert sum(r[index]["held"] for r in per_rank) == case["seq"], case  # the cache is split, not copied
        for rank, results in enumerate(per_rank):
            mine = results[index]
            assert mine["max_abs_error"] <= TOLERANCE[case["dtype"]], f"rank {rank}: {case}"
            assert mine["out_dtype"] == f"mlx.core.{case['dtype']}", case
            assert mine["values"] == result["values"], f"ranks disagree: {case}"  # same bits everywhere
    assert [r[3]["held"] for r in per_rank] == [1, 0]  # a rank holding no key contributes nothing


GENERATE_PROMPT = ("Ring attention splits a long sequence across machines. Each rank keeps a shard of the "
                   "keys and values, and the partial results merge through the log-sum-exp. Explain it briefly.")
GENERATE_TOKENS = 6


def test_distributed_generation_equals_the_single_process_greedy_tokens(tmp_path):
    from model_fixtures import smollm2

    from mlx_attn.lm.generate import GenerationConfig, generate_tokens

    model, tokenizer = smollm2()
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": GENERATE_PROMPT}],
                                                            add_generation_prompt=True), add_special_tokens=False)
    assert len(prompt) >= 40  # several tokens per rank and chunk
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompt": prompt, "max_tokens": GENERATE_TOKENS}))
    # every rank loads SmolLM2: slow on a loaded 2-core machine (about 30 s when idle)
    per_rank = _launch(2, "generate", tmp_path, str(request), timeout_s=3 * LAUNCH_TIMEOUT_S)
    expected = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=GENERATE_TOKENS, stop_at_eos=False)))
    assert len(expected) == GENERATE_TOKENS
    for rank, result in enumerate(per_rank):
        assert result["tokens"] == expected, f"rank {rank}"
        held = result["held"]
        assert len(set(held)) == 1, "every layer holds the same positions"
        assert held[0] >= len(prompt) // 4, f"rank {rank} holds only {held[0]} tokens"
    # every position's K/V (the prompt but its last token, then one per decoded token) is held exactly once
    assert sum(r["held"][0] for r in per_rank) == len(prompt) - 1 + GENERATE_TOKENS


def test_distributed_generation_with_different_prompts_fails_on_every_rank(tmp_path):
    for rank, result in enumerate(_launch(2, "generate_mismatch", tmp_path)):
        assert result["error"] is not None and "differ across ranks" in result["error"], rank


def test_cli_distributed_prints_the_single_process_text_on_rank_0_only(tmp_path, capsys):
    from model_fixtures import random_llama, tiny_vocabulary, write_llama_gguf

    from mlx_attn.lm.cli import main as cli_main

    vocab = len(tiny_vocabulary()[0])  # a tiny model: this test is about the command, not the numbers
    model = write_llama_gguf(tmp_path / "tiny.gguf", model=random_llama(rope_traditional=True, vocab_size=vocab),
                             llama__vocab_size=vocab)
    argv = ["generate", "--model", str(model), "--prompt", "the then in the " * 8, "--max-tokens", "5",
            "--ignore-chat-template", "--quiet"]
    command = ring_command(2, [sys.executable, "-m", "mlx_attn.lm.cli", *argv, "--distributed"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert cli_main(argv) == 0
    single = capsys.readouterr().out
    assert len(single) > len("the then in the " * 8) and done.stdout == single  # printed once: rank 1 is silent


def test_cli_distributed_without_a_group_says_how_to_launch(capsys, monkeypatch):
    from mlx_attn.lm.cli import main as cli_main

    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    assert cli_main(["generate", "--distributed", "--prompt", "hi", "--max-tokens", "2"]) == 2
    error = capsys.readouterr().err
    assert "--distributed needs a distributed group of more than one rank" in error and "mlx.launch -n 2" in error


@pytest.mark.parametrize("flags,named", [(["--max-kv-size", "64"], "--max-kv-size"), (["--kv-bits", "8"], "--kv-bits"),
                                         (["--prompt-cache-file", "cache.safetensors"], "--prompt-cache-file")])
def test_cli_distributed_refuses_options_it_does_not_support(capsys, flags, named):
    from mlx_attn.lm.cli import main as cli_main

    assert cli_main(["generate", "--distributed", "--prompt", "hi", *flags]) == 2
    error = capsys.readouterr().err
    assert named in error and "cannot be combined with" in error, error


def test_distributed_generate_step_needs_a_group_of_several_ranks():
    from mlx_attn.lm.distributed_generate import distributed_generate_step
    from mlx_attn.lm.generate import GenerationConfig
    from model_fixtures import tiny_llama

    model = tiny_llama()
    steps = distributed_generate_step(model, [1, 2, 3], GenerationConfig(max_tokens=2), mx.distributed.init())
    with pytest.raises(ValueError, match="more than one rank.*mlx.launch"):
        next(steps)
    steps = distributed_generate_step(model, [1, 2], GenerationConfig(max_tokens=2), group="world")
    with pytest.raises(ValueError, match="group must be an mx.distributed.Group"):
        next(steps)


# --------------------------------------------------------------------------
# the benchmark script


def test_benchmark_smoke_run(tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_distributed.py"
    spec = importlib.util.spec_from_file_location("bench_distributed", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_distributed.json").read_text())
    assert saved["table"] == table
    assert (tmp_path / "bench_distributed.png").stat().st_size > 10_000
    assert {(row["ranks"], row["seq_len"]) for row in table} == {(1, 512), (1, 1024), (2, 512), (2, 1024)}
    for row in table:
        assert row["peak_mib_per_rank"] > 0 and row["seconds_slowest_rank"] > 0
        if row["ranks"] == 2:
            assert 0.5 <= row["sent_vs_lower_bound"] <= 1.1  # zigzag causal: rank 0 skips a chunk nobody needs
            assert row["work_max_vs_mean"] <= 1.1
            assert row["peak_vs_single"] < 1.5
    assert not list(tmp_path.glob(".bench_distributed_*"))  # per-rank files cleaned up
