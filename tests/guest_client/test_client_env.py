"""How a guest learns who it is: the HOSTCALL_* variables and the credential."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from client_fakehost import CREDENTIAL, EXECUTION, FAST_RETRY, ScriptedHost, ok

from guest_client import ConfigurationError, GuestEnvironment, HostcallError, connect
from guest_client import env as guest_env_module


@pytest.fixture
def credential_pipe(
    guest_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[int, int]]:
    """A pipe named by HOSTCALL_CREDENTIAL_FD, as the supervisor passes it;
    HOSTCALL_CREDENTIAL is unset. Yields (read fd, write fd)."""
    read_fd, write_fd = os.pipe()
    inodes = {fd: os.fstat(fd).st_ino for fd in (read_fd, write_fd)}
    monkeypatch.delenv("HOSTCALL_CREDENTIAL")
    monkeypatch.setenv("HOSTCALL_CREDENTIAL_FD", str(read_fd))
    yield read_fd, write_fd
    for fd, inode in inodes.items():
        # Closed already (by the test or the client) and maybe reused since:
        # close only what is still this pipe.
        if _is_same_open_file(fd, inode):
            os.close(fd)


def _is_same_open_file(fd: int, inode: int) -> bool:
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def test_the_credential_is_read_from_the_fd_to_eof_and_the_fd_is_closed(
    host: ScriptedHost, credential_pipe: tuple[int, int]
) -> None:
    read_fd, write_fd = credential_pipe
    pipe_inode = os.fstat(read_fd).st_ino
    os.write(write_fd, f"  {CREDENTIAL}\n".encode())
    os.close(write_fd)
    host.answer(ok("c", 1))

    with connect(retry=FAST_RETRY) as client:
        assert not _is_same_open_file(read_fd, pipe_inode)
        client.call("charge", call_id="c")

    assert host.requests[0].headers["authorization"] == f"Bearer {CREDENTIAL}"


def test_a_second_connect_in_the_same_process_reuses_the_credential_read_from_the_fd(
    host: ScriptedHost, credential_pipe: tuple[int, int]
) -> None:
    _, write_fd = credential_pipe
    os.write(write_fd, CREDENTIAL.encode())
    os.close(write_fd)
    host.answer(ok("a", 1), ok("b", 2))

    with connect(retry=FAST_RETRY) as first:
        first.call("charge", call_id="a")
    with connect(retry=FAST_RETRY) as second:
        second.call("charge", call_id="b")

    assert [request.headers["authorization"] for request in host.requests] == [
        f"Bearer {CREDENTIAL}"
    ] * 2


def test_a_credential_pipe_left_open_fails_instead_of_hanging(
    credential_pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, write_fd = credential_pipe
    os.write(write_fd, CREDENTIAL.encode())  # but the write end stays open
    monkeypatch.setattr(guest_env_module, "CREDENTIAL_READ_TIMEOUT_S", 0.1)

    with pytest.raises(ConfigurationError) as caught:
        connect()

    assert "end of file" in str(caught.value)
    assert CREDENTIAL not in str(caught.value)


def test_an_fd_that_is_not_open_fails_with_a_configuration_error(
    credential_pipe: tuple[int, int],
) -> None:
    read_fd, _ = credential_pipe
    os.close(read_fd)

    with pytest.raises(ConfigurationError, match="cannot read the credential"):
        connect()


def test_a_credential_fd_that_is_not_a_number_is_named_in_the_error(
    guest_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTCALL_CREDENTIAL_FD", "three")

    with pytest.raises(ConfigurationError, match="HOSTCALL_CREDENTIAL_FD='three'"):
        connect()


def test_the_credential_comes_from_the_environment_when_no_fd_is_named(
    guest_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTCALL_CREDENTIAL", f"\t{CREDENTIAL} \n")

    headers = connect().environment.identity_headers()

    assert headers["Authorization"] == f"Bearer {CREDENTIAL}"
    assert headers["Hostcall-Execution"] == EXECUTION


def test_missing_variables_raise_not_a_guest_naming_every_missing_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith("HOSTCALL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOSTCALL_SOCKET", "/run/channel.sock")

    with pytest.raises(ConfigurationError) as caught:
        connect()

    error = caught.value
    assert isinstance(error, HostcallError)
    assert error.code == "not_a_guest"
    for name in ("HOSTCALL_INVOCATION", "HOSTCALL_EXECUTION", "HOSTCALL_PLAN"):
        assert name in str(error)
    assert "HOSTCALL_CREDENTIAL_FD" in str(error)
    assert "HOSTCALL_SOCKET" not in str(error)


def test_a_credential_that_is_not_a_bearer_token_is_refused_without_quoting_it(
    guest_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = "secret with spaces\r\nInjected: header"
    monkeypatch.setenv("HOSTCALL_CREDENTIAL", bad)

    with pytest.raises(ConfigurationError) as caught:
        connect()

    assert "secret" not in str(caught.value)
    assert "secret" not in repr(caught.value)


def test_an_id_that_cannot_travel_in_a_header_is_refused(
    guest_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTCALL_INVOCATION", "inv 1\r\nX: y")

    with pytest.raises(ConfigurationError, match="HOSTCALL_INVOCATION"):
        connect()


def test_the_environment_repr_hides_the_credential() -> None:
    environment = GuestEnvironment(
        socket_path="/run/c.sock",
        invocation="inv_1",
        execution="exe_1",
        plan_hash="sha256:" + "0" * 64,
        credential=CREDENTIAL,
    )

    assert CREDENTIAL not in repr(environment)
    assert "exe_1" in repr(environment)
