"""Who this guest is: the `HOSTCALL_*` variables and the credential.

The supervisor hands the credential over through an inherited pipe
(`HOSTCALL_CREDENTIAL_FD`) so that it never shows in `/proc/<pid>/environ`.
A pipe can be read only once, so the credential read from it is kept for the
rest of the process and later `connect()` calls reuse it.
"""

from __future__ import annotations

import _thread
import os
import time

from guest_client.errors import ConfigurationError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["GuestEnvironment"]

SOCKET_VAR = "HOSTCALL_SOCKET"
INVOCATION_VAR = "HOSTCALL_INVOCATION"
EXECUTION_VAR = "HOSTCALL_EXECUTION"
PLAN_VAR = "HOSTCALL_PLAN"
CREDENTIAL_FD_VAR = "HOSTCALL_CREDENTIAL_FD"
CREDENTIAL_VAR = "HOSTCALL_CREDENTIAL"

# The supervisor writes the credential and closes its end at once; a pipe that
# stays open past this is a broken launch, not a slow one.
CREDENTIAL_READ_TIMEOUT_S = 10.0
# A credential is 43 characters; anything near this is not a credential.
MAX_CREDENTIAL_BYTES = 4096

# RFC 6750 bearer tokens use the token68 alphabet (RFC 7235 section 2.1).
# Checking it here also keeps a malformed credential from ever reaching the
# request encoder, whose errors name a bad header.
_TOKEN68 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/")
# Visible ASCII: what an id may hold to travel as a header value.
_VISIBLE = frozenset(chr(c) for c in range(0x21, 0x7F))
_MAX_ID_LENGTH = 256

# execution id -> credential read from the fd. Guarded by _lock.
_credentials: dict[str, str] = {}
_lock = _thread.allocate_lock()


class GuestEnvironment:
    """The identity and address of this guest, as the supervisor set them.

    `repr()` never shows the credential.

    Attributes:
        socket_path: The channel's Unix socket.
        invocation: The invocation id.
        execution: The execution id.
        plan_hash: `sha256:<hex>` of the plan.
    """

    __slots__ = ("_credential", "execution", "invocation", "plan_hash", "socket_path")

    def __init__(
        self,
        *,
        socket_path: str,
        invocation: str,
        execution: str,
        plan_hash: str,
        credential: str,
    ) -> None:
        """Raises:
        ConfigurationError: A value cannot be sent as the protocol needs.
        """
        if not socket_path:
            raise ConfigurationError(f"{SOCKET_VAR} is empty")
        for name, value in (
            (INVOCATION_VAR, invocation),
            (EXECUTION_VAR, execution),
            (PLAN_VAR, plan_hash),
        ):
            if not _is_header_safe(value):
                raise ConfigurationError(
                    f"{name}={value!r} is not a valid id "
                    f"(1-{_MAX_ID_LENGTH} visible ASCII characters)"
                )
        if not _is_token68(credential):
            # Never quote the value: it is the secret.
            raise ConfigurationError("the credential is not a bearer token (base64url expected)")
        self.socket_path = socket_path
        self.invocation = invocation
        self.execution = execution
        self.plan_hash = plan_hash
        self._credential = credential

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> GuestEnvironment:
        """Read the guest's identity from the environment.

        The credential comes from the fd named by `HOSTCALL_CREDENTIAL_FD`,
        read to EOF and closed (once per process: later calls reuse it), else
        from `HOSTCALL_CREDENTIAL`. Surrounding whitespace is stripped.

        Args:
            environ: The variables; `os.environ` by default.

        Raises:
            ConfigurationError: A variable is missing or unusable, or the
                credential cannot be read.
        """
        env = os.environ if environ is None else environ
        values = {
            name: env.get(name, "").strip()
            for name in (SOCKET_VAR, INVOCATION_VAR, EXECUTION_VAR, PLAN_VAR)
        }
        missing = [name for name, value in values.items() if not value]
        fd_text = env.get(CREDENTIAL_FD_VAR, "").strip()
        if not fd_text and not env.get(CREDENTIAL_VAR, "").strip():
            missing.append(f"{CREDENTIAL_FD_VAR} (or {CREDENTIAL_VAR})")
        if missing:
            raise ConfigurationError(
                "not running as a hostcall guest: "
                f"{', '.join(missing)} not set (the supervisor sets them "
                "when it launches a guest)"
            )
        execution = values[EXECUTION_VAR]
        if fd_text:
            credential = _credential_from_fd(execution, fd_text)
        else:
            credential = env.get(CREDENTIAL_VAR, "").strip()
        return cls(
            socket_path=values[SOCKET_VAR],
            invocation=values[INVOCATION_VAR],
            execution=execution,
            plan_hash=values[PLAN_VAR],
            credential=credential,
        )

    def identity_headers(self) -> dict[str, str]:
        """The headers that identify this guest on every request (docs/protocol.md)."""
        return {
            "Authorization": f"Bearer {self._credential}",
            "Hostcall-Invocation": self.invocation,
            "Hostcall-Execution": self.execution,
            "Hostcall-Plan": self.plan_hash,
        }

    def __repr__(self) -> str:
        return (
            f"GuestEnvironment(socket_path={self.socket_path!r}, "
            f"invocation={self.invocation!r}, execution={self.execution!r}, "
            f"plan_hash={self.plan_hash!r}, credential=<hidden>)"
        )


def _is_header_safe(value: str) -> bool:
    return 0 < len(value) <= _MAX_ID_LENGTH and all(c in _VISIBLE for c in value)


def _is_token68(value: str) -> bool:
    body = value.rstrip("=")
    return 0 < len(body) <= MAX_CREDENTIAL_BYTES and all(c in _TOKEN68 for c in body)


def _credential_from_fd(execution: str, fd_text: str) -> str:
    with _lock:
        cached = _credentials.get(execution)
        if cached is not None:
            return cached
        try:
            fd = int(fd_text)
        except ValueError:
            raise ConfigurationError(
                f"{CREDENTIAL_FD_VAR}={fd_text!r} is not a file descriptor number"
            ) from None
        if fd < 0:
            raise ConfigurationError(
                f"{CREDENTIAL_FD_VAR}={fd_text!r} is not a file descriptor number"
            )
        try:
            data = _read_to_eof(fd)
        finally:
            # Read once, then gone: a child started later cannot inherit it.
            try:  # noqa: SIM105 - contextlib would cost import time
                os.close(fd)
            except OSError:
                pass
        try:
            credential = data.decode("ascii").strip()
        except UnicodeDecodeError:
            raise ConfigurationError(f"the credential read from fd {fd} is not ASCII") from None
        if not credential:
            raise ConfigurationError(f"the credential fd {fd} was empty")
        _credentials[execution] = credential
        return credential


def _read_to_eof(fd: int) -> bytes:
    import select  # Only a guest that reads its credential from a pipe needs it.

    deadline = time.monotonic() + CREDENTIAL_READ_TIMEOUT_S
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise ConfigurationError(
                f"the credential fd {fd} did not reach end of file within "
                f"{CREDENTIAL_READ_TIMEOUT_S:g} s"
            )
        try:
            chunk = os.read(fd, 4096)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read the credential from fd {fd}: {exc.strerror}"
            ) from exc
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_CREDENTIAL_BYTES:
            raise ConfigurationError(
                f"the credential fd {fd} holds more than {MAX_CREDENTIAL_BYTES} bytes"
            )
