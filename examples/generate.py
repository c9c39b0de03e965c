"""Generate text with SmolLM2-135M-Instruct whose attention runs through mlx_attn.

    python examples/generate.py --prompt "What is the capital of France?"
    python examples/generate.py --backend reference --ignore-chat-template "The capital of France is"
    python examples/generate.py --temp 0.7 --seed 0 --verbose --prompt "Tell me a joke."

Same options as `mlx-attn generate` (see `mlx-attn generate --help`).
"""

import sys

from mlx_attn.lm.__main__ import main  # the mlx-attn command: binds a system OpenBLAS first, as the CLI does

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
