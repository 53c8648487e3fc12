"""Building WebAssembly guests from source, with tools from PyPI (docs/wasm.md).

- C → a WASI preview 1 command, with the C compiler in the ``ziglang`` wheel:
  no system toolchain, no WASI SDK to download (:func:`build_c`).
- Python → a WebAssembly component of the world ``agent`` in
  ``channel/hostcall.wit``, with ``componentize-py``, which bundles a CPython
  built for WASI (:func:`build_python`).

The example guests, the tests, the fault harness, the benchmark and ``hostcall
demo --wasm`` build theirs here. A build is kept under a hash of its sources,
so a second one is free.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from supervisor.errors import WasmError

__all__ = ["BUILD_TIMEOUT_S", "WIT", "build_c", "build_python"]

#: The first C build also builds zig's WASI libc (~30 s on 2 cores); later ones
#: take < 1 s. A Python component takes ~10 s.
BUILD_TIMEOUT_S: Final = 600.0
C_FLAGS: Final = ("-target", "wasm32-wasi", "-O2", "-s")
#: The WIT of component guests.
WIT: Final = Path(__file__).resolve().parents[1] / "channel" / "hostcall.wit"
_COMPONENTIZE: Final = (
    "import sys; from componentize_py import script; "
    "sys.argv[0] = 'componentize-py'; sys.exit(script())"
)


def build_c(source: Path, out_dir: Path, *, flags: Sequence[str] = C_FLAGS) -> Path:
    """``source`` (C) compiled to a WASI command in ``out_dir``; returns the module.

    Raises:
        WasmError: ``ziglang`` is not installed, or the compiler failed (its
            message included).
    """
    digest = _digest([source.read_bytes(), "\0".join(flags).encode()])

    def command(partial: Path) -> list[str]:
        return [sys.executable, "-m", "ziglang", "cc", *flags, str(source), "-o", str(partial)]

    return _build(out_dir / f"{source.stem}-{digest}.wasm", command, "ziglang", source.name)


def build_python(app: Path, out_dir: Path, *, module: str = "app") -> Path:
    """The Python program in folder ``app`` (its ``module``.py defines
    ``WitWorld.run``) built to a component in ``out_dir``; returns it.

    Raises:
        WasmError: ``componentize-py`` is not installed, or the build failed.
    """
    sources = sorted(app.rglob("*.py"))
    digest = _digest([WIT.read_bytes(), *(p.read_bytes() + str(p).encode() for p in sources)])

    def command(partial: Path) -> list[str]:
        return [
            *(sys.executable, "-c", _COMPONENTIZE, "--quiet", "-d", str(WIT), "-w", "agent"),
            *("componentize", module, "-p", str(app), "-o", str(partial)),
        ]

    return _build(out_dir / f"{app.name}-{digest}.wasm", command, "componentize-py", app.name)


def _digest(parts: Sequence[bytes]) -> str:
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(hashlib.sha256(part).digest())
    return hashed.hexdigest()[:16]


def _build(out: Path, command: Callable[[Path], list[str]], tool: str, what: str) -> Path:
    """Run ``command(partial)``, which writes ``partial``, then move it to ``out``."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.partial")
    try:
        done = subprocess.run(
            command(partial), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise WasmError(f"building {what} took over {BUILD_TIMEOUT_S:g} s") from None
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        if "No module named" in done.stderr:
            raise WasmError(f"building {what} needs the {tool} wheel: pip install {tool}")
        raise WasmError(f"building {what} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    partial.replace(out)  # whole or not at all, also with builds side by side
    return out
