"""Thermostat's CPU kernels (cpu_kernels.cpp), compiled for this machine on first use.

`ops()` returns the compiled module, or None where the kernels cannot run here: a CPU without
AVX-512 BF16, no C++ compiler, or THERMOSTAT_KERNELS=0 in the environment. The model then takes
its pure-PyTorch path, which is also the reference the kernels are tested against. The build is
cached by torch (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), so only the first start on
a machine pays the compile (about 30 s); why the kernels are off is logged once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("thermostat.kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# Instruction sets the source uses (Linux /proc/cpuinfo names).
REQUIRED_CPU_FLAGS = ("avx2", "f16c", "fma", "avx512f", "avx512bw", "avx512_bf16")

_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used on this machine, or None if they can be built."""
    if os.environ.get("THERMOSTAT_KERNELS", "1") == "0":
        return "THERMOSTAT_KERNELS=0"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def ops() -> ModuleType | None:
    """The compiled kernels, or None (the reason is logged once and kept in `status()`)."""
    with _lock:
        if "ops" not in _state:
            _state["ops"], _state["reason"] = _build()
            if _state["ops"] is None:
                log.warning("CPU kernels off (%s): using the PyTorch path", _state["reason"])
        return _state["ops"]  # type: ignore[return-value]


def status() -> str:
    """One line for startup logs and bench reports."""
    module = ops()
    if module is None:
        return f"off ({_state['reason']})"
    return "on (AMX for decode batches)" if module.vnni_max_rows() > 2 else "on (no AMX)"


def _build() -> tuple[ModuleType | None, str | None]:
    reason = unavailable_reason()
    if reason:
        return None, reason
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    log.info("loading CPU kernels (compiled on the first start on a machine, ~30 s)")
    try:
        module = load(
            name="thermostat_cpu_kernels",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a toolchain without these intrinsics
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"build failed: {first_line}"
    log.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
    return module, None
