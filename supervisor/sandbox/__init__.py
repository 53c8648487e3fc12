"""The guest sandbox (docs/sandbox.md): bubblewrap namespaces and mounts around every guest.

- :mod:`.policy` — the plan's ``[sandbox]`` table and what a writable path may not hold;
- :mod:`.paths` — what the guest's command needs from the host, and who may reach it;
- :mod:`.layout` — the guest's view of the file system, mount by mount;
- :mod:`.bwrap` — what this host allows, and one guest's bubblewrap command;
- :mod:`.gate` — the shell line a guest's program runs behind, on the supervisor's go-ahead;
- :mod:`.seccomp` — the system calls a guest may not make;
- :mod:`.start` — starting and stopping a sandboxed guest;
- :mod:`.usage` — what it uses, and the limits it may not cross.

Its cgroup is :mod:`supervisor.cgroups`; :mod:`supervisor.guests` puts it all
together for the supervisor.
"""

from __future__ import annotations

from supervisor.sandbox.bwrap import (
    DEFAULT_GUEST_UID,
    NO_SANDBOX_HINT,
    SandboxHost,
    SandboxLaunch,
    bwrap_executable,
)
from supervisor.sandbox.layout import GUEST_SOCKET, GUEST_WORKDIR
from supervisor.sandbox.policy import SandboxError, SandboxPolicy, check_writable, trusted_paths

__all__ = [
    "DEFAULT_GUEST_UID",
    "GUEST_SOCKET",
    "GUEST_WORKDIR",
    "NO_SANDBOX_HINT",
    "SandboxError",
    "SandboxHost",
    "SandboxLaunch",
    "SandboxPolicy",
    "bwrap_executable",
    "check_writable",
    "trusted_paths",
]
