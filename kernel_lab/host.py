"""The machine a benchmark ran on, for its JSON record."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def cpu_description() -> dict:
    """CPU model and instruction-set features, for the JSON record."""
    info = {"machine": platform.machine(), "model": platform.processor() or "unknown", "features": []}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                info["model"] = value.strip()
            elif key.strip() in ("vendor_id", "cpu family", "model", "CPU implementer", "CPU part"):
                name = "model_number" if key.strip() == "model" else key.strip().replace(" ", "_")
                info.setdefault(name, value.strip())
            elif key.strip() in ("flags", "Features") and not info["features"]:
                wanted = ("avx", "fma", "f16c", "asimd", "fphp", "bf16", "sve", "amx")
                info["features"] = sorted(f for f in value.split() if f.startswith(wanted) or f in wanted)
    elif platform.system() == "Darwin":
        brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        info["model"] = brand.stdout.strip() or info["model"]
    return info
