"""The mutant-application loop of the Metal mutation batteries
(test_metal_mutations.py, test_quantized_metal_mutations.py,
test_metal_backward_mutations.py): seed one textual fault into a copy of a
kernel source, compile it in the MSL emulator beside the unchanged sources,
and require the battery to catch it. A mutation whose target text is missing
(or, for a replacement, not unique) fails, so none can silently test nothing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import EmulatedMetal


QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*\n?', re.MULTILINE)
PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[^\n]*\n?", re.MULTILINE)


def kernel_text(metal_file: Path) -> str:
    """A kernel family's whole source: the .metal instantiation file with the
    project headers it includes inlined (each once, as the Mac's run-time
    compile sees it), so a mutation may target the kernel header, the shared
    steps (metal/attention_steps.h) or the rules (metal/attention_rules.h),
    and the mutant changes that family only."""
    root = metal_file.resolve().parent.parent
    inlined: set[str] = set()

    def inline(text: str) -> str:
        def replace(match: re.Match) -> str:
            if match.group(1) in inlined:
                return ""
            inlined.add(match.group(1))
            return inline(PRAGMA_ONCE.sub("", (root / match.group(1)).read_text()))
        return QUOTED_INCLUDE.sub(replace, text)

    return inline(metal_file.read_text())


def mutated(text: str, kind: str, target: str, change) -> str:
    """`text` with the mutation applied: ("replace", a, b) replaces the one
    occurrence of a by b; ("remove", a, n) removes the statement starting at
    the n-th occurrence of a (up to its `;`)."""
    if kind == "remove":
        starts = [m.start() for m in re.finditer(re.escape(target), text)]
        assert len(starts) > change, f"mutation target {target!r} occurs {len(starts)} times"
        start = starts[change]
        return text[:start] + text[text.index(";", start) + 1:]
    assert text.count(target) == 1, f"mutation target {target!r} must occur exactly once"
    return text.replace(target, change)


def write(directory: Path, text: str, name: str) -> Path:
    path = directory / f"{re.sub(r'[^a-z0-9]+', '_', name.lower())}.metal"
    path.write_text(text)
    return path


def assert_caught(name: str, sources: list[Path], caught: Callable[[EmulatedMetal], bool],
                  counters: bool = False) -> None:
    """Compiles `sources` (one of them mutated) and asserts that the battery
    `caught` tells the mutant from the original, or that the compiler
    rejects it. `counters`: the counting build, which also fails a device
    access off its alignment (docs/msl_emulator.md)."""
    try:
        run = EmulatedMetal(fast_math=True, sources=sources, counters=counters)
    except msl_emulator.MetalCompileError:
        return  # caught by the compiler
    assert caught(run), f"mutant survived: {name}"
