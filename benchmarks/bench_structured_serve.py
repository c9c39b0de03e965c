"""What constrained decoding (``response_format`` json_schema) costs the
server: SmolLM2-135M served in this process (uvicorn on 127.0.0.1), streamed
greedy chat requests.

- aggregate generated tokens/s at concurrency 16, unconstrained against
  mixed (8 of the 16 requests constrained to a schema whose answer is longer
  than ``max_tokens``, so every request generates ``max_tokens`` tokens either
  way); the two loads alternate for ``--rounds`` rounds and the medians are
  compared, so a drift in a shared machine's load falls on both alike;
- the grammar's share of the mixed load's engine time, timed inside the
  engine (masks, their bias, the matchers' advance against whole steps):
  what the tokens/s comparison measures, without the machine's noise;
- time to first token of one request alone: unconstrained, constrained with
  a schema compiled before (cached), and with a fresh schema (compiled for
  the request): the p50 of each and the TTFT the grammar adds.

    python benchmarks/bench_structured_serve.py [--rounds 3] [--max-tokens 48]

Every request is bounded in time; the phases in count.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import socket
import statistics
import threading
import time

REQUEST_LIMIT_S = 600.0
QUESTIONS = ["Explain how a bicycle stays upright.", "Write a short poem about the sea.",
             "Give three tips for learning to cook.", "Describe the water cycle.", "Why is the sky blue?",
             "Tell a short story about a brave mouse.", "How do plants make food?", "Why do we need sleep?"]
# an inventory of at least 12 items: longer than max_tokens, every request runs to the limit
INVENTORY = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 12, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                         "kind": {"enum": ["tool", "food", "book", "toy"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "kind", "count"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "inventory", "schema": schema, "strict": True}}


def fresh_schema(i: int) -> dict:
    return {**INVENTORY, "description": f"inventory {i} {time.time_ns()}"}  # never in the cache


def chat(port: int, question: str, max_tokens: int, response_format: dict | None) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if response_format is not None:
        body["response_format"] = response_format
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_LIMIT_S)
    first, usage = None, None
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for _ in range(100_000):  # bounded: one line per event
            line = response.readline().strip()
            if not line:
                if response.isclosed():
                    break
                continue
            if line == b"data: [DONE]":
                break
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            if first is None and any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                first = time.perf_counter() - start
    finally:
        conn.close()
    return {"ttft": first, "tokens": usage["completion_tokens"], "seconds": time.perf_counter() - start}


def anthropic_message(port: int, question: str, max_tokens: int) -> dict:
    """One streamed greedy request to the Anthropic endpoint, read as chat() reads OpenAI's."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_LIMIT_S)
    first, tokens = None, None
    try:
        conn.request("POST", "/v1/messages", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for _ in range(100_000):  # bounded: one line per event
            line = response.readline().strip()
            if not line.startswith(b"data:"):
                if not line and response.isclosed():
                    break
                continue
            event = json.loads(line[5:])
            if event["type"] == "content_block_delta" and first is None and event["delta"].get("text"):
                first = time.perf_counter() - start
            elif event["type"] == "message_delta":
                tokens = event["usage"]["output_tokens"]
            elif event["type"] == "message_stop":
                break
    finally:
        conn.close()
    return {"ttft": first, "tokens": tokens, "seconds": time.perf_counter() - start}


def load(port: int, max_tokens: int, constrained: int, endpoint: str = "openai") -> dict:
    """16 requests at once, the first ``constrained`` of them to INVENTORY
    (``endpoint`` "anthropic": none constrained, sent to /v1/messages)."""
    jobs = [(QUESTIONS[i % len(QUESTIONS)], schema_format(INVENTORY) if i < constrained else None)
            for i in range(16)]

    def send(job):
        if endpoint == "anthropic":
            return anthropic_message(port, job[0], max_tokens)
        return chat(port, job[0], max_tokens, job[1])

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, jobs))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


class Timers:
    """Seconds spent in wrapped functions (the engine's step, the grammar's parts)."""

    def __init__(self):
        self.seconds = {}

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def reset(self):
        self.seconds = {}


def serve(port: int):
    import uvicorn

    from mlx_attn.lm import load_model
    from mlx_attn.serve.server import create_app, make_state

    model, tokenizer = load_model()
    state = make_state(model, tokenizer, "smollm2", kv_cache_tokens=16384)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > end or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, (tokenizer, model.config.vocab_size)


def rates(rounds: list[dict]) -> str:
    return ", ".join(f"{r['tokens_per_s']:.1f}" for r in rounds)


def main(argv=None) -> dict:
    from mlx_attn.serve.constraints import json_grammars

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["structured", "endpoints"], default="structured",
                        help="structured: constrained decoding's cost; endpoints: Anthropic against OpenAI tokens/s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ttft-requests", type=int, default=5)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from mlx_attn.serve.constraints import GrammarConstraint
    from mlx_attn.serve.engine import Engine

    timers = Timers()
    timers.wrap(Engine, "step", "step")
    timers.wrap(Engine, "_bias", "grammar")  # the masks and their bias
    timers.wrap(GrammarConstraint, "advance", "grammar")
    server, thread, (tokenizer, vocab) = serve(port)
    if args.mode == "endpoints":
        return compare_endpoints(port, args, server, thread)
    try:
        chat(port, QUESTIONS[0], 4, schema_format(INVENTORY))  # warm: the grammar's tokenizer, the first steps
        load(port, args.max_tokens, 8)  # warm: batch-16 steps
        plain, mixed, shares = [], [], []
        for _ in range(args.rounds):
            plain.append(load(port, args.max_tokens, 0))
            timers.reset()
            mixed.append(load(port, args.max_tokens, 8))
            shares.append(timers.seconds.get("grammar", 0.0) / timers.seconds["step"])
        ttft = {"unconstrained": [], "cached schema": [], "fresh schema": []}
        for i in range(args.ttft_requests):
            question = QUESTIONS[i % len(QUESTIONS)]
            ttft["unconstrained"].append(chat(port, question, 2, None)["ttft"])
            ttft["cached schema"].append(chat(port, question, 2, schema_format(INVENTORY))["ttft"])
            ttft["fresh schema"].append(chat(port, question, 2, schema_format(fresh_schema(i)))["ttft"])
        compiles = []  # the compile alone, in this process: what the TTFT above holds of it
        grammars = json_grammars(tokenizer, vocab)
        for i in range(args.ttft_requests):
            start = time.perf_counter()
            grammars.factory(fresh_schema(1000 + i))
            compiles.append(time.perf_counter() - start)
    finally:
        server.should_exit = True
        thread.join(60)
    plain_tps = statistics.median(r["tokens_per_s"] for r in plain)
    mixed_tps = statistics.median(r["tokens_per_s"] for r in mixed)
    p50 = {name: 1e3 * statistics.median(values) for name, values in ttft.items()}
    lines = ["| load (concurrency 16, greedy) | tokens | tokens/s per round | median tokens/s |", "|---|---|---|---|",
             f"| unconstrained | {plain[0]['tokens']} | {rates(plain)} | {plain_tps:.1f} |",
             f"| mixed (8 json_schema) | {mixed[0]['tokens']} | {rates(mixed)} | {mixed_tps:.1f} |",
             f"\nmixed against unconstrained: {100 * (mixed_tps / plain_tps - 1):+.1f} % aggregate tokens/s "
             f"(medians of {args.rounds} alternating rounds)",
             f"grammar work inside the engine's steps under the mixed load: "
             f"{', '.join(f'{100 * x:.2f} %' for x in shares)} of step time\n",
             "| request alone | TTFT p50 ms | added by the grammar ms |", "|---|---|---|"]
    for name, value in p50.items():
        lines.append(f"| {name} | {value:.1f} | {value - p50['unconstrained']:.1f} |")
    lines.append(f"\ncompiling a fresh schema (grammar + first matcher), in process: "
                 f"p50 {1e3 * statistics.median(compiles):.2f} ms")
    print("\n".join(lines))
    return {"plain": plain, "mixed": mixed, "grammar_share": shares, "ttft_p50_ms": p50, "compile_ms": [1e3 * c for c in compiles]}


def compare_endpoints(port: int, args, server, thread) -> dict:
    """The same unconstrained concurrency-16 load through both APIs, alternating."""
    try:
        load(port, args.max_tokens, 0)  # warm: batch-16 steps
        load(port, args.max_tokens, 0, "anthropic")
        openai_rounds, anthropic_rounds = [], []
        for i in range(args.rounds):  # the order flips each round: neither side always runs first
            for endpoint in (("openai", "anthropic") if i % 2 == 0 else ("anthropic", "openai")):
                (openai_rounds if endpoint == "openai" else anthropic_rounds).append(
                    load(port, args.max_tokens, 0, endpoint))
    finally:
        server.should_exit = True
        thread.join(60)
    openai_tps = statistics.median(r["tokens_per_s"] for r in openai_rounds)
    anthropic_tps = statistics.median(r["tokens_per_s"] for r in anthropic_rounds)
    print("\n".join([
        "| endpoint (concurrency 16, greedy, unconstrained) | tokens | tokens/s per round | median tokens/s |",
        "|---|---|---|---|",
        f"| /v1/chat/completions | {openai_rounds[0]['tokens']} | {rates(openai_rounds)} | {openai_tps:.1f} |",
        f"| /v1/messages | {anthropic_rounds[0]['tokens']} | {rates(anthropic_rounds)} | {anthropic_tps:.1f} |",
        f"\nAnthropic against OpenAI: {100 * (anthropic_tps / openai_tps - 1):+.1f} % aggregate tokens/s "
        f"(medians of {args.rounds} alternating rounds)"]))
    return {"openai": openai_rounds, "anthropic": anthropic_rounds}


if __name__ == "__main__":
    main()
