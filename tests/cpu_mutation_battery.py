"""The CPU kernels' mutation batteries, written once: seed one fault into a
kernel header under csrc/cpu/, build the generic (MLX_ATTN_ISA generic)
copy of it (or the battery's own unit, e.g. the avx512amx copy) into a
standalone driver (tests/cpu_harness/*_driver.cpp), and
require the driver to fail. The unchanged header is built beside the mutant
and must pass first, so a mutant cannot be "caught" by a broken driver.
Needs clang (clang-19); without it the test skips with the reason, except on
CI (CI set), where it fails. Used by tests/test_matvec_mutations.py,
tests/test_paged_cpu_mutations.py and tests/test_amx_cpu_mutations.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-std=c++20", "-O1", "-ffp-contract=fast", "-fno-math-errno"]


def cpu_has_amx_bf16() -> bool:
    """Whether /proc/cpuinfo lists AMX tiles with bf16 (the avx512amx copies' CPU)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)


def selected(mutants: list, default: list) -> list:
    """Every mutant with MLX_ATTN_FULL_GRID=1, else the default few."""
    return mutants if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else default


@dataclass(frozen=True)
class CpuMutationBattery:
    header: str  # the kernel header under csrc/cpu/ the mutants change
    unit: str  # the name of the generic translation unit and its object
    driver: str  # the driver under tests/cpu_harness/
    name: str  # what the battery checks, for its messages
    # The translation unit's text (default: the generic copy of the header)
    # and the compile flags it needs beyond FLAGS (a wide copy's ISA).
    unit_source: str | None = None
    isa_flags: tuple = ()

    @property
    def kernel(self) -> Path:
        return ROOT / "csrc" / "cpu" / self.header

    def clang(self) -> str:
        for name in ("clang++-19", "clang++"):
            if shutil.which(name):
                return name
        if os.environ.get("CI"):
            pytest.fail(f"the {self.name} mutation battery needs clang++ on CI")
        pytest.skip(f"clang++ (clang-19) not found: the {self.name} mutation battery cannot build its driver")

    def start_build(self, clang: str, kernel_text: str, out: Path) -> subprocess.Popen:
        """Builds the driver against the generic copy of `kernel_text` (the
        kernel header, possibly mutated) in the background."""
        include = out / "include"
        (include / "csrc" / "cpu").mkdir(parents=True)
        (include / "csrc" / "cpu" / self.header).write_text(kernel_text)
        unit = out / f"{self.unit}_generic.cpp"
        unit.write_text(self.unit_source or f'#define MLX_ATTN_ISA generic\n#include "csrc/cpu/isa_generic.h"\n'
                        f'#include "csrc/cpu/{self.header}"\n')
        driver = ROOT / "tests" / "cpu_harness" / self.driver
        obj = out / f"{self.unit}.o"
        flags = " ".join([*FLAGS, *self.isa_flags])
        script = (f"{clang} {flags} -I{include} -I{ROOT} -c {unit} -o {obj} && "
                  f"{clang} {flags} -I{ROOT} {driver} {obj} -lm -o {out / 'driver'}")
        return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    @staticmethod
    def driver_passes(out: Path) -> bool:
        return subprocess.run([str(out / "driver")], capture_output=True, text=True, timeout=120).returncode == 0

    def assert_targets_exist(self, mutants: list) -> None:
        """Every mutant's target occurs exactly once in the header (cheap:
        run by default, so a refactor cannot silently strand the full grid)."""
        source = self.kernel.read_text()
        stranded = [name for name, target, _ in mutants if source.count(target) != 1]
        assert not stranded, f"mutation targets not found exactly once in {self.header}: {stranded}"

    def assert_caught(self, tmp_path: Path, name: str, target: str, replacement: str) -> None:
        """The original and the mutant (target replaced, occurring exactly
        once) built in parallel; the original must pass its driver, the
        mutant fail to build or fail the driver."""
        clang = self.clang()
        source = self.kernel.read_text()
        assert source.count(target) == 1, f"mutation target {target!r} must occur exactly once in {self.header}"
        builds = {
            "original": self.start_build(clang, source, tmp_path / "original"),
            "mutant": self.start_build(clang, source.replace(target, replacement), tmp_path / "mutant"),
        }
        logs = {key: proc.communicate()[0] for key, proc in builds.items()}
        assert builds["original"].returncode == 0, f"building the {self.name} driver failed:\n{logs['original']}"
        assert self.driver_passes(tmp_path / "original"), f"the unchanged kernel fails the {self.name} driver"
        if builds["mutant"].returncode != 0:
            return  # caught by the compiler
        assert not self.driver_passes(tmp_path / "mutant"), f"mutant survived: {name}"
