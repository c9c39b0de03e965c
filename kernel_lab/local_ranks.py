"""Several ranks on this machine: a program started by ``mlx.launch`` with
the ring backend on 127.0.0.1, each rank writing its results as JSON. The
one home of this launch for the distributed tests (tests/distributed_worker.py
is the program) and benchmarks/bench_distributed.py: development tooling,
kept in kernel_lab, not in mlx_attn."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

LOCALHOST = "127.0.0.1"


def free_port_base(count: int) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (one per
    rank: the ring backend's ``--starting-port``)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((LOCALHOST, 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                held.append(socket.socket())
                held[-1].bind((LOCALHOST, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no run of {count} free ports on {LOCALHOST}")


def launcher() -> list[str]:
    """``mlx.launch``: the console script beside this Python or on PATH, else
    the module behind it."""
    beside_python = Path(sys.executable).with_name("mlx.launch")
    found = str(beside_python) if beside_python.exists() else shutil.which("mlx.launch")
    if found is None:
        return [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
    return [found]


def ring_command(ranks: int, program: Sequence[str]) -> list[str]:
    """The command that runs ``program`` (an argv) as ``ranks`` processes of
    this machine in one ring group."""
    return [*launcher(), "-n", str(ranks), "--backend", "ring", "--hosts", LOCALHOST,
            "--starting-port", str(free_port_base(ranks)), *program]


def result_path(results_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` writes its JSON results."""
    return Path(results_dir) / f"rank{rank}.json"


def write_result(results_dir: Path | str, rank: int, payload) -> None:
    """A rank's JSON results at :func:`result_path`, whole or not at all."""
    path = result_path(results_dir, rank)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(payload))
    partial.replace(path)


def run_ranks(ranks: int, program: Sequence[str], results_dir: Path | str, *, timeout_s: float) -> list:
    """Runs ``program`` as ``ranks`` ranks (one rank: the program itself,
    without a launcher) and returns each rank's results, read from
    :func:`result_path`. Raises RuntimeError with the output if a rank
    failed; subprocess.TimeoutExpired past ``timeout_s``."""
    command = ring_command(ranks, program) if ranks > 1 else list(program)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} ranks of {' '.join(program)} failed ({done.returncode}):\n"
                           f"{done.stdout}\n{done.stderr}")
    return [json.loads(result_path(results_dir, rank).read_text()) for rank in range(ranks)]
