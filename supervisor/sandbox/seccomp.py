"""A small seccomp filter for every sandboxed guest (bubblewrap's ``--seccomp``).

The namespaces keep the guest from seeing anything outside its sandbox; a few
system calls would still let it reach into what is inside, or share state with
other guests through the kernel. The filter refuses them (``EPERM``):

- ``ptrace``, ``process_vm_readv``/``writev``, ``process_madvise``,
  ``pidfd_getfd``: the sandbox's own pid 1 (bubblewrap's) shares the guest's
  uid when the supervisor is not root; a guest that could trace it could clear
  its parent-death signal and outlive a killed supervisor (docs/security.md, S5);
- ``keyctl``, ``add_key``, ``request_key``: a root supervisor runs every guest
  as uid 65534, whose kernel keyring they would all share;
- ``bpf``, ``userfaultfd``: kernel attack surface no agent needs;
- ``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``: the same,
  the source of many of the kernel's recent privilege escalations (as in
  Docker's and ChromeOS's filters); answered ``ENOSYS``, as on a kernel
  without it, so runtimes that try it (libuv) fall back to what they did
  before;
- ``unshare`` and ``clone`` asking for a new user namespace (a root
  supervisor's guest could otherwise make one and get capabilities in it);
  ``clone3`` is answered ``ENOSYS``, so the C library falls back to ``clone``,
  whose flags a filter can read;
- every system call of another ABI (32-bit x86 or arm, x32): ``ENOSYS``.

Classic BPF, assembled here: a dozen instructions, no libseccomp.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass
from typing import Final

__all__ = ["supported", "syscall_filter"]

# <linux/filter.h>, <linux/seccomp.h>, <linux/audit.h>
_LD_ABS_W: Final = 0x20
_JEQ: Final = 0x15
_JGE: Final = 0x35
_JSET: Final = 0x45
_RET: Final = 0x06
_ALLOW: Final = 0x7FFF0000
_ERRNO: Final = 0x00050000
_NR: Final = 0  # offsetof(struct seccomp_data, nr)
_ARCH: Final = 4
_ARG0_LOW: Final = 16  # args[0], low 32 bits (little-endian)
CLONE_NEWUSER: Final = 0x10000000
_X32_BIT: Final = 0x40000000


@dataclass(frozen=True, slots=True)
class _Abi:
    audit_arch: int
    x32_bit: bool
    denied: tuple[int, ...]
    unshare: int
    clone: int
    #: Answered ENOSYS: clone3, and io_uring's three calls.
    nosys: tuple[int, ...]


_ABIS: Final = {
    # ptrace, process_vm_readv, process_vm_writev, process_madvise, pidfd_getfd,
    # keyctl, add_key, request_key, bpf, userfaultfd
    # then unshare, clone; clone3, io_uring_setup, io_uring_enter, io_uring_register
    "x86_64": _Abi(
        0xC000003E,
        True,
        (101, 310, 311, 440, 438, 250, 248, 249, 321, 323),
        272,
        56,
        (435, 425, 426, 427),
    ),
    "aarch64": _Abi(
        0xC00000B7,
        False,
        (117, 270, 271, 440, 438, 219, 217, 218, 280, 282),
        97,
        220,
        (435, 425, 426, 427),
    ),
}


def supported() -> bool:
    """Whether a filter exists for this machine's architecture."""
    return platform.machine() in _ABIS


def syscall_filter() -> bytes:
    """The filter as ``struct sock_filter[]`` bytes, for bubblewrap's ``--seccomp FD``.

    Raises:
        RuntimeError: no filter for this architecture (see :func:`supported`).
    """
    abi = _ABIS.get(platform.machine())
    if abi is None:
        raise RuntimeError(f"no seccomp filter for {platform.machine()}")
    program: list[tuple[int, str | int, str | int, int]] = [
        (_LD_ABS_W, 0, 0, _ARCH),
        (_JEQ, 0, "nosys", abi.audit_arch),
        (_LD_ABS_W, 0, 0, _NR),
    ]
    if abi.x32_bit:
        program.append((_JGE, "nosys", 0, _X32_BIT))
    for number in abi.nosys:
        program.append((_JEQ, "nosys", 0, number))
    program.append((_JEQ, "flags", 0, abi.unshare))
    program.append((_JEQ, "flags", 0, abi.clone))
    for number in abi.denied:
        program.append((_JEQ, "deny", 0, number))
    program.append((_RET, 0, 0, _ALLOW))
    labels = {"flags": len(program)}
    program.append((_LD_ABS_W, 0, 0, _ARG0_LOW))
    program.append((_JSET, "deny", 0, CLONE_NEWUSER))
    program.append((_RET, 0, 0, _ALLOW))
    labels["deny"] = len(program)
    program.append((_RET, 0, 0, _ERRNO | errno.EPERM))
    labels["nosys"] = len(program)
    program.append((_RET, 0, 0, _ERRNO | errno.ENOSYS))

    def offset(index: int, target: str | int) -> int:
        if isinstance(target, int):
            return target
        jump = labels[target] - index - 1
        assert 0 <= jump < 256, "a BPF jump reaches 255 instructions at most"
        return jump

    return b"".join(
        struct.pack("<HBBI", code, offset(i, jt), offset(i, jf), k)
        for i, (code, jt, jf, k) in enumerate(program)
    )
