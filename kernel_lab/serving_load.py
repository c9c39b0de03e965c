"""The request load the serving benchmarks share (``benchmarks/bench_serve.py``,
``benchmarks/bench_mlx_lm_models.py``): a server process on 127.0.0.1, one
streamed greedy chat request, and a phase of requests at a fixed
concurrency with aggregate tokens/s and time-to-first-token percentiles.
Every request and server start is bounded in time."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import statistics
import subprocess
import time
from pathlib import Path

QUESTIONS = [
    "Explain how a bicycle stays upright.", "Write a short poem about the sea.",
    "What is the capital of France and why is it famous?", "Give three tips for learning to cook.",
    "Describe the water cycle.", "Why is the sky blue?", "Tell a short story about a brave mouse.",
    "How do plants make food?", "What are the planets of the solar system?", "Explain what a computer does.",
    "Why do we need sleep?", "Describe a day at the beach.", "How does a rainbow form?",
    "What makes a good friend?", "Explain how bread rises.", "Why do leaves change colour in autumn?",
]
REQUEST_LIMIT_S = 900.0  # one request, at most
START_LIMIT_S = 600.0  # one server start, at most


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1, stopped on exit. ``cwd``: where it
    runs (outside a source checkout, so ``python -m`` imports the installed
    package); ``env``: variables set for it on top of this process's."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, cwd: Path | None = None,
                 env: dict | None = None):
        self.name, self.port = name, port
        self.log = open(log, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        end = time.monotonic() + START_LIMIT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode}; see {log}")
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"{name} did not answer within {START_LIMIT_S:.0f} s; see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)

    def peak_memory(self) -> int | None:
        """The process's peak resident memory in bytes so far (Linux's
        VmHWM), or None where /proc does not say."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
        return None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self.log.close()


def chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy chat request: time to first token, tokens, time."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_LIMIT_S)
    first, pieces, usage = None, 0, None
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for _ in range(100_000):  # bounded: one line per event
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    pieces += 1
                    if first is None:
                        first = time.perf_counter() - start
    finally:
        conn.close()
    tokens = usage["completion_tokens"] if usage and usage.get("completion_tokens") else pieces
    return {"ttft": first if first is not None else time.perf_counter() - start, "tokens": tokens,
            "seconds": time.perf_counter() - start}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def load_phase(port: int, concurrency: int, requests: int, max_tokens: int) -> dict:
    """``requests`` chat requests, ``concurrency`` at a time."""
    prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(requests)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda m: chat(port, m, max_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": requests, "max_tokens": max_tokens, "tokens": tokens,
            "seconds": wall, "tokens_per_s": tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p95": percentile(ttfts, 0.95)}
