"""Build the native kernels now (setup, the decode actor's start), so no request waits for a
compiler: ``python -m engine.quant.build``. Prints one line; exits 1 when they cannot be built
(the engine then runs on the torch fallback, slower but exact)."""

from __future__ import annotations

import sys
import time


def main() -> int:
    from engine.quant.kernels import extension_error, load_extension

    t = time.perf_counter()
    ext = load_extension()
    if ext is None:
        print(f"moestream native kernels unavailable (torch fallback in use): {extension_error()}",
              file=sys.stderr)
        return 1
    print(f"moestream native kernels ready in {time.perf_counter() - t:.1f} s "
          f"(int8 activations: {'yes' if ext.has_int8_dots() else 'no'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
