"""Where the PostgreSQL tests get their server: never a silent skip in CI."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests import postgres_support
from tests.postgres_support import answers, find_server_binaries, postgres_server, throwaway_cluster


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_configured_server_that_does_not_answer_fails_the_tests_instead_of_skipping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{_closed_port()}/test"
    monkeypatch.setenv(postgres_support.ENV_DSN, dsn)
    monkeypatch.setattr(postgres_support, "CI_WAIT_S", 0.5)

    with pytest.raises(pytest.fail.Exception, match="does not answer"), postgres_server():
        pass


@pytest.mark.parametrize(
    ("ci", "outcome"), [("", pytest.skip.Exception), ("true", pytest.fail.Exception)]
)
def test_with_no_server_and_no_binaries_the_tests_skip_saying_why_except_in_ci(
    monkeypatch: pytest.MonkeyPatch, ci: str, outcome: type[BaseException]
) -> None:
    monkeypatch.delenv(postgres_support.ENV_DSN, raising=False)
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(postgres_support, "answers", lambda dsn: "connection refused")
    monkeypatch.setattr(postgres_support, "find_server_binaries", lambda: None)

    with pytest.raises(outcome, match="no initdb/pg_ctl was found"), postgres_server():
        pass


def test_a_throwaway_cluster_answers_on_its_private_socket_and_is_removed_afterwards() -> None:
    binaries = find_server_binaries()
    if binaries is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    with throwaway_cluster(binaries) as dsn:
        problem = answers(dsn)
        root = Path(dsn.split("host=")[1].split("&")[0].replace("%2F", "/"))
        socket_exists = any(root.glob(".s.PGSQL.*"))

    assert problem is None
    assert socket_exists
    assert not root.exists()
