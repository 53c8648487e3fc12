"""Compiling a C guest to WebAssembly with the ``ziglang`` wheel (docs/wasm.md).

The example guests, the tests, the fault harness and the benchmark build their
WebAssembly guests from C source here, with the C compiler that ships in the
``ziglang`` wheel on PyPI (``pip install ziglang``): no system toolchain, no
WASI SDK to download. A build is kept under its source's hash, so a second
one is free.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from supervisor.errors import WasmError

__all__ = ["BUILD_TIMEOUT_S", "build_wasm"]

#: The first build also builds zig's WASI libc (~30 s on 2 cores); later ones take < 1 s.
BUILD_TIMEOUT_S: Final = 600.0
FLAGS: Final = ("-target", "wasm32-wasi", "-O2", "-s")


def build_wasm(source: Path, out_dir: Path, *, flags: Sequence[str] = FLAGS) -> Path:
    """``source`` (C) compiled to a WASI command in ``out_dir``; returns the module.

    Raises:
        WasmError: ``ziglang`` is not installed, or the compiler failed (its
            message included).
    """
    digest = hashlib.sha256(source.read_bytes() + "\0".join(flags).encode()).hexdigest()[:16]
    module = out_dir / f"{source.stem}-{digest}.wasm"
    if module.is_file():
        return module
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = module.with_suffix(f".{os.getpid()}.partial")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ziglang", "cc", *flags, str(source), "-o", str(partial)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise WasmError(f"building {source.name} took over {BUILD_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        if "No module named ziglang" in done.stderr:
            raise WasmError(
                "building a WebAssembly guest needs the ziglang wheel: pip install ziglang"
            )
        raise WasmError(f"building {source.name} failed: {done.stderr.strip()[-2000:]}")
    partial.replace(module)  # whole or not at all, also with builds side by side
    return module
