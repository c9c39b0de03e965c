"""The ``mlx-attn`` command (also ``python -m mlx_attn.lm``): binds a system
OpenBLAS for MLX's float32 matmuls (:func:`mlx_attn.use_system_blas`, which
must run before MLX is imported), then runs :func:`mlx_attn.lm.cli.main`."""

from __future__ import annotations

import sys

from mlx_attn._blas import use_system_blas


def main(argv: list[str] | None = None) -> int:
    use_system_blas()
    from mlx_attn.lm.cli import main as cli_main  # noqa: PLC0415 (imports MLX: after the BLAS choice)

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
