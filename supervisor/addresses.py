"""Addresses the command line takes: ``[HOST:]PORT`` for the console (loopback
only) and ``HOST:PORT`` for metrics. Standard library only: the CLI parses
them before it loads anything heavy."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

__all__ = ["CONSOLE_PORT", "Listen", "parse_host_port", "parse_listen"]

#: The port ``hostcall console`` listens on unless told (docs/console.md).
CONSOLE_PORT: Final = 8765


@dataclass(frozen=True, slots=True)
class Listen:
    """Where the console listens: a loopback host and a port (0: any free one)."""

    host: str
    port: int


def parse_listen(value: str) -> Listen:
    """``[HOST:]PORT`` → :class:`Listen`; ``HOST`` must be a loopback address
    (``localhost`` is 127.0.0.1; IPv6 in brackets, ``[::1]:8765``).

    Raises:
        ValueError: not ``[HOST:]PORT``, or ``HOST`` is not loopback.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", value
    host = host.strip("[]") or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{value!r} is not [HOST:]PORT") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not 0-65535")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (use 127.0.0.1 or ::1)") from None
    if not address.is_loopback:
        raise ValueError(f"{host} is not a loopback address: the console listens on loopback only")
    return Listen(str(address), port)


def parse_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) → ``(host, port)``.

    Raises:
        ValueError: not ``HOST:PORT``.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not HOST:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{value!r} is not HOST:PORT") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not 0-65535")
    return host.strip("[]"), port
