"""The seam between the channel and whatever owns executions.

The channel authenticates a request and hands it to the execution's broker
through these protocols; it never imports the supervisor.
"""

from __future__ import annotations

from typing import Any, Protocol

from channel.wire import CallReply

__all__ = ["BrokerPort", "ExecutionDirectory", "ExecutionPort"]


class BrokerPort(Protocol):
    """What the channel asks of an execution's broker."""

    async def call(self, call_id: str, tool: str, args: dict[str, Any]) -> CallReply:
        """Run the pipeline of docs/protocol.md for one call and return its reply."""
        ...

    async def status(self, call_id: str, wait_s: float) -> CallReply:
        """The state of a call, waiting up to ``wait_s`` while it is in flight."""
        ...

    async def plan_view(self) -> dict[str, Any]:
        """The body of ``GET /v1/plan``."""
        ...


class ExecutionPort(Protocol):
    """One execution as the channel sees it: identity facts and its broker."""

    @property
    def execution_id(self) -> str: ...

    @property
    def invocation_id(self) -> str: ...

    @property
    def plan_hash(self) -> str: ...

    @property
    def credential_sha256(self) -> bytes:
        """SHA-256 of the credential; the credential itself is never kept."""
        ...

    @property
    def live(self) -> bool:
        """False once the execution ended, was cancelled or was fenced."""
        ...

    @property
    def guest_pid(self) -> int | None:
        """Pid of the guest's root process, once launched."""
        ...

    @property
    def guest_pidns(self) -> int | None:
        """Inode of the guest's pid namespace (``readlink /proc/<pid>/ns/pid``
        shows ``pid:[N]``) when it runs in a sandbox; None when it does not.

        Set no later than ``guest_pid``: the channel checks the origin of a
        guest whose ``guest_pid`` is known by namespace if this is set, by
        process ancestry if not.
        """
        ...

    @property
    def guest_uid(self) -> int | None:
        """The uid the guest's processes have, seen from outside; None: the
        supervisor's own uid (an unsandboxed guest, or a sandbox in a user
        namespace that maps our uid to itself)."""
        ...

    async def wait_launched(self, timeout_s: float) -> None:
        """Wait (bounded) until ``guest_pid`` (and ``guest_pidns``) is known: a
        fast guest may call before the supervisor has finished recording its
        launch."""
        ...

    @property
    def broker(self) -> BrokerPort: ...


class ExecutionDirectory(Protocol):
    """Finds executions by id (live or ended ones: ended ones are fenced)."""

    def lookup(self, execution_id: str) -> ExecutionPort | None: ...
