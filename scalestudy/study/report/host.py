"""What a report's numbers were computed on: the host's CPU model, the JAX and jaxlib (XLA)
builds and the devices. The same host and builds reproduce a study's losses and report to
the bit; another CPU or XLA build moves the last digits (docs/results-smoke.md)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux's /proc/cpuinfo, else the platform's processor string)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_line() -> str:
    """One sentence naming the host, the JAX/jaxlib builds and the devices, for a report."""
    import jax
    import jaxlib

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return (
        f"This page was computed on: {cpu_model()} ({platform.system()} {platform.machine()}); JAX "
        f"{jax.__version__}, jaxlib {jaxlib.__version__} (its XLA build); {len(devices)} "
        f"{devices[0].platform} device(s) ({', '.join(kinds)}). Losses and this page are "
        "bit-reproducible on the same host and builds; on another, digits may move but the "
        "verdicts must not (docs/results-smoke.md)."
    )
