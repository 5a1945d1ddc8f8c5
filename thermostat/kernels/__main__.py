"""`python -m thermostat.kernels`: builds (or finds) the CPU kernels for this machine and says
which in one line. Exits 0 also where they are off, so setup passes on any CPU; 1 only when the
build fails on a CPU that can run them (the compiler's output then goes to stderr)."""

from __future__ import annotations

import sys
import time

from thermostat.kernels.build import (
    build_failure,
    load_or_build,
    module_path,
    this_key,
    unavailable_reason,
)


def main() -> int:
    reason = unavailable_reason()
    if reason:
        print(f"CPU kernels off: {reason}")
        return 0
    key = this_key()
    path = module_path(key)
    found = path.exists()
    start = time.perf_counter()
    try:
        load_or_build(key)
    except Exception as exc:  # no compiler, no ninja, a toolchain without these intrinsics
        print(exc, file=sys.stderr)
        print(f"CPU kernels {build_failure(exc)}")
        return 1
    if found:
        print(f"CPU kernels already built at {path}")
    else:
        print(f"CPU kernels built in {time.perf_counter() - start:.1f} s at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
