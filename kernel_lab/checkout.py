"""The mlx_attn checkout whose metal/ sources the lab compiles and runs."""

from __future__ import annotations

import os
from pathlib import Path

ENVIRONMENT_VARIABLE = "MLX_ATTN_REPO"


def is_checkout(path: Path) -> bool:
    return (path / "metal").is_dir() and (path / "kernel_lab" / "pyproject.toml").is_file()


def find_checkout(start: Path | None = None) -> Path:
    """$MLX_ATTN_REPO; else the checkout this package lies in (an editable
    install, or a run from the source tree); else the first checkout at or
    above `start` (default: the working directory, for a copy installed into
    site-packages and run from inside a checkout)."""
    if os.environ.get(ENVIRONMENT_VARIABLE):
        path = Path(os.environ[ENVIRONMENT_VARIABLE]).resolve()
        if not is_checkout(path):
            raise RuntimeError(f"${ENVIRONMENT_VARIABLE}={path} is not an mlx_attn checkout (no metal/ or kernel_lab/)")
        return path
    here = Path(__file__).resolve().parent.parent
    if is_checkout(here):
        return here
    start = (start or Path.cwd()).resolve()
    for path in (start, *start.parents):
        if is_checkout(path):
            return path
    raise RuntimeError(f"kernel_lab cannot find the mlx_attn checkout: install it editable (pip install -e "
                       f"./kernel_lab), run from inside the checkout, or set ${ENVIRONMENT_VARIABLE}")


REPO = find_checkout()
