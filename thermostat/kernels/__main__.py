"""`python -m thermostat.kernels`: builds (or finds) the CPU kernels for this machine (the full
build, else the AVX2 one) and says which in one line. Exits 0 also where they are off, so setup
passes on any CPU; 1 only when the build fails on a CPU that can run it (the compiler's output then
goes to stderr)."""

from __future__ import annotations

import sys
import time

from thermostat.kernels.build import (
    AVX2,
    FULL,
    build_failure,
    load_or_build,
    module_path,
    this_key,
    unavailable_reason,
)


def main() -> int:
    build, reason = FULL, unavailable_reason(FULL)
    if reason and unavailable_reason(AVX2) is None:
        build, which = AVX2, f"CPU kernels (AVX2: {reason})"
    elif reason:
        print(f"CPU kernels off: {reason}")
        return 0
    else:
        which = "CPU kernels"
    key = this_key(build)
    path = module_path(key, build)
    found = path.exists()
    start = time.perf_counter()
    try:
        load_or_build(key, build)
    except Exception as exc:  # no compiler, no ninja, a toolchain without these intrinsics
        print(exc, file=sys.stderr)
        print(f"{which} {build_failure(exc)}")
        return 1
    if found:
        print(f"{which} already built at {path}")
    else:
        print(f"{which} built in {time.perf_counter() - start:.1f} s at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
