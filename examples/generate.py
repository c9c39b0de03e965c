"""Generate text with SmolLM2-135M-Instruct whose attention runs through mlx_attn.

    python examples/generate.py "The capital of France is"
    python examples/generate.py --backend reference "The capital of France is"
    python examples/generate.py --chat --temp 0.7 --seed 0 "Tell me a joke."

Same options as `mlx-attn generate` (see `mlx-attn generate --help`).
"""

import sys

from mlx_attn.lm.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
