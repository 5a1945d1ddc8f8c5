"""Building the kernels for this machine, cached per distinct build: cpu_kernels.cpp (`FULL`:
AVX-512 with VNNI; bf16 dot products in hardware where the CPU has AVX512-BF16, else emulated) or,
on a CPU with AVX2 only, avx2_kernels.cpp (`AVX2`: the same ops in 8-float registers).

Everything that changes the binary is hashed into one key, and each key has its own directory
under `cache_root()` ($THERMOSTAT_KERNEL_CACHE, else ~/.cache/thermostat/kernels):

| path                                   | what                                              |
|----------------------------------------|---------------------------------------------------|
| <key>/<build name>_<key>.so            | the published module: complete (os.replace) or absent |
| <key>/build/                           | torch's build directory (ninja file, objects, lock) |

key = `cache_key(source bytes, torch version, Python ABI tag, compiler flags, CPU ISA flags)`.
Checkouts, venvs and machines (a home directory shared between CPUs) whose builds differ never
rebuild over each other; equal keys share one build. A start with the module published imports it
directly (no compiler, no ninja); `python -m thermostat.kernels` (run by tools/setup.sh) publishes
it ahead, and a first use without it builds it then.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# /proc/cpuinfo flags that -march=native turns into code (instruction sets), by prefix; the
# others (bugs, power management, virtualisation) do not change the binary.
ISA_FLAG_PREFIXES = ("avx", "amx", "sse", "ssse", "fma", "f16c", "bmi", "abm", "popcnt", "movbe")


@dataclass(frozen=True)
class Build:
    """One compiled module: its source (with the headers it includes: common.h, torch_ops.h,
    decode_stack.h, and in the AVX-512 build prefill_attention.h), its name, and the instruction
    sets (Linux /proc/cpuinfo names) it needs."""

    name: str
    source: Path
    cpu_flags: tuple[str, ...]
    what: str  # for logs
    cflags: tuple[str, ...] = ()  # after CFLAGS

    def source_bytes(self) -> bytes:
        names = ("common.h", "torch_ops.h", "decode_stack.h", "prefill_attention.h")
        headers = (HERE / name for name in names)
        return b"\0".join([self.source.read_bytes(), *(h.read_bytes() for h in headers)])


# AVX-512 with VNNI: Intel from Cascade Lake, AMD from Zen 4. AVX512-BF16 (AMD Zen 4/5, Intel
# Cooper Lake, Sapphire Rapids on) and AMX are used where present; without AVX512-BF16 (Cascade
# and Ice Lake, VMs that hide it) its bf16 dot products are emulated (cpu_kernels.cpp).
FULL = Build(
    "thermostat_cpu_kernels",
    HERE / "cpu_kernels.cpp",
    ("avx2", "f16c", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "(AVX-512)",
)
# FULL with its bf16 dot products emulated even where the CPU has AVX512-BF16, for the tests: so
# that the machines which have it (AMD Zen 4/5) test the arithmetic that Cascade and Ice Lake run.
FULL_EMULATED = Build(
    "thermostat_cpu_kernels_emulated",
    FULL.source,
    FULL.cpu_flags,
    "(AVX-512, bf16 dot products emulated)",
    ("-mno-avx512bf16",),
)
# FULL without AMX even where the CPU has it, for the tests: so that the machines which have it
# (Intel Sapphire Rapids on) test the bf16 dot products and VNNI that AMD Zen 4/5 run.
FULL_NO_AMX = Build(
    "thermostat_cpu_kernels_no_amx",
    FULL.source,
    FULL.cpu_flags,
    "(AVX-512, no AMX)",
    ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
)
# The same ops for CPUs with AVX2 but not FULL's instruction sets.
AVX2 = Build(
    "thermostat_avx2_kernels",
    HERE / "avx2_kernels.cpp",
    ("avx2", "f16c", "fma"),
    "(AVX2)",
)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def unavailable_reason(build: Build = FULL) -> str | None:
    """Why `build` cannot be used on this machine, or None if it can be built."""
    if os.environ.get("THERMOSTAT_KERNELS", "1") == "0":
        return "THERMOSTAT_KERNELS=0"
    missing = [f for f in build.cpu_flags if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def cache_key(
    source: bytes,
    torch_version: str,
    python_tag: str,
    build_flags: Iterable[str],
    cpu_isa_flags: Iterable[str],
) -> str:
    """16 hex digits over everything the compiled module depends on. Flag order is kept for the
    compiler flags (it matters to the compiler) and ignored for the CPU's."""
    digest = hashlib.sha256(source)
    for part in (torch_version, python_tag, " ".join(build_flags), " ".join(sorted(cpu_isa_flags))):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    custom = os.environ.get("THERMOSTAT_KERNEL_CACHE")
    return Path(custom) if custom else Path.home() / ".cache" / "thermostat" / "kernels"


def this_key(build: Build = FULL) -> str:
    """The key of this checkout's source of `build` with this torch, Python and CPU."""
    import torch

    isa = {f for f in cpu_flags() if f.startswith(ISA_FLAG_PREFIXES)}
    return cache_key(
        build.source_bytes(),
        torch.__version__,
        sys.implementation.cache_tag,
        CFLAGS + build.cflags + LDFLAGS,
        isa,
    )


def module_path(key: str, build: Build = FULL) -> Path:
    return cache_root() / key / f"{build.name}_{key}.so"


def load_or_build(key: str, build: Build = FULL) -> ModuleType:
    """Imports the published module of `key`, building and publishing it first if absent.
    Raises whatever the build raises (no compiler, no ninja, a toolchain without the
    intrinsics)."""
    import torch  # noqa: F401  (the module links against the libtorch this loads)

    name, path = f"{build.name}_{key}", module_path(key, build)
    if not path.exists():
        from torch.utils.cpp_extension import load

        build_dir = path.parent / "build"
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's file lock in build_dir makes a concurrent build of the same key wait.
        built = load(
            name=name,
            sources=[str(build.source)],
            extra_cflags=list(CFLAGS + build.cflags),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            verbose=False,
        )
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        shutil.copyfile(built.__file__, partial)
        os.replace(partial, path)
        module: ModuleType = built
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_failure(exc: Exception) -> str:
    """One line for why `load_or_build` raised (torch's message goes on with the compiler's
    output)."""
    text = str(exc).strip()
    return f"build failed: {text.splitlines()[0] if text else type(exc).__name__}"
