"""Which grammar library masks tokens fastest for the server's structured
output: llguidance, xgrammar and outlines-core, each installed, on the default
model's tokenizer (SmolLM2-135M, 49 152 tokens).

For each library: the one-off tokenizer setup, the compile time of a JSON
schema of the kind agents send (cold: a fresh schema each time), and the
per-step cost of 16 rows (batch 16) each computing its token bitmask and
advancing by one token along a valid answer. A library that is not installed
is reported as such.

    python benchmarks/bench_grammar_mask.py [--steps 40] [--schemas 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import numpy as np

BATCH = 16

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "role": "editor", "tags": ["math", "engines"],
          "address": {"city": "London", "zip": "10001"}, "active": True}


def fresh_schema(i: int) -> dict:
    """The schema with a distinct description: no library can reuse a cache."""
    schema = copy.deepcopy(SCHEMA)
    schema["description"] = f"record {i}"
    return schema


def default_tokenizer():
    from mlx_attn.lm import load_model

    _, tokenizer = load_model()
    return tokenizer


# ---------------------------------------------------------------- libraries
class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab):
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                                eos_token=sorted(tokenizer.eos_token_ids))
        self.words = (vocab + 31) // 32

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return grammar

    def matcher(self, compiled):
        matcher = self.llg.LLMatcher(self.tokenizer, compiled)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher, bitmask, row):
        row_mask = bitmask[row]
        matcher.unsafe_compute_mask_ptr(row_mask.ctypes.data, row_mask.nbytes)

    def advance(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab):
        import xgrammar

        self.xgr = xgrammar
        backend = tokenizer.backend
        encoded = [backend.id_to_token(i) or "" for i in range(backend.get_vocab_size())]
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(self._torch_mask(bitmask), row)

    def _torch_mask(self, bitmask):
        import torch

        return torch.from_numpy(bitmask)

    def advance(self, matcher, token):
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab):
        import outlines_core

        self.oc = outlines_core
        eos = min(tokenizer.eos_token_ids)
        backend = tokenizer.backend
        byte_of = {c: b for b, c in _byte_level_table().items()}
        tokens: dict[bytes, list[int]] = {}
        for i in range(backend.get_vocab_size()):
            piece = backend.id_to_token(i)
            if i == eos or piece is None:
                continue
            if all(c in byte_of for c in piece):
                tokens.setdefault(bytes(byte_of[c] for c in piece), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask, row):
        row_mask = bitmask[row]
        matcher.write_mask_into(row_mask.ctypes.data, row_mask.size, row_mask.itemsize)

    def advance(self, matcher, token):
        matcher.advance(token)


def _byte_level_table() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


LIBRARIES = [LLGuidance, XGrammar, OutlinesCore]


# ---------------------------------------------------------------- measure
def measure(library_class, tokenizer, vocab, answer_tokens, steps, schemas):
    start = time.perf_counter()
    library = library_class(tokenizer, vocab)
    setup = time.perf_counter() - start
    compiles = []
    for i in range(schemas):
        start = time.perf_counter()
        compiled = library.compile(fresh_schema(i))
        library.matcher(compiled)  # some libraries finish compiling here
        compiles.append(time.perf_counter() - start)
    compiled = library.compile(SCHEMA)
    matchers = [library.matcher(compiled) for _ in range(BATCH)]
    bitmask = np.full((BATCH, (vocab + 31) // 32), -1, dtype=np.int32)
    step_times = []
    for step in range(min(steps, len(answer_tokens))):
        token = answer_tokens[step]
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            library.fill(matcher, bitmask, row)
        step_times.append(time.perf_counter() - start)
        assert (bitmask[0, token // 32] >> (token % 32)) & 1, f"{library.name} masks out the answer's token at step {step}"
        for matcher in matchers:
            library.advance(matcher, token)
    return {"library": library.name, "setup_s": setup, "compile_ms_p50": 1e3 * statistics.median(compiles),
            "batch16_mask_ms_p50": 1e3 * statistics.median(step_times),
            "batch16_mask_ms_max": 1e3 * max(step_times),
            "per_row_mask_us": 1e6 * statistics.median(step_times) / BATCH}


def table(rows) -> str:
    lines = ["| library | tokenizer setup s | schema compile ms p50 | mask, batch 16, ms/step p50 | max | µs/row p50 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['library']} | {r['error']} | | | | |")
        else:
            lines.append(f"| {r['library']} | {r['setup_s']:.2f} | {r['compile_ms_p50']:.1f} | "
                         f"{r['batch16_mask_ms_p50']:.2f} | {r['batch16_mask_ms_max']:.2f} | {r['per_row_mask_us']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per library")
    parser.add_argument("--schemas", type=int, default=5, help="fresh schemas compiled per library")
    args = parser.parse_args(argv)
    tokenizer = default_tokenizer()
    vocab = tokenizer.vocab_size
    answer_tokens = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    rows = []
    for library_class in LIBRARIES:
        try:
            rows.append(measure(library_class, tokenizer, vocab, answer_tokens, args.steps, args.schemas))
        except ImportError as error:
            rows.append({"library": library_class.name, "error": f"not installed ({error.name})"})
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
