"""What guest code imports to call host tools: standard library only.

    from guest_client import connect

    client = connect()
    client.tools()
    client.call("charge", {"account": "acct_1", "cents": 500}, call_id="call_7")
    client.status("call_7")

The same with asyncio is `guest_client.aio.AsyncHostClient`; model adapters
(`call_openai`, `call_anthropic`, `tools_for`) are methods of both clients,
built on `guest_client.adapters`. docs/guests.md is the guide.

Importing this package takes a few milliseconds: `socket` loads with the
first request, `random` with the first retry, `uuid` with the
first minted `call_id`, and `asyncio` only with `guest_client.aio`.
"""

from __future__ import annotations

from guest_client.client import HostClient, connect
from guest_client.env import GuestEnvironment
from guest_client.errors import (
    ConfigurationError,
    EffectUnknown,
    HostcallError,
    ProtocolError,
    Refused,
    ResultInvalid,
    ToolError,
    TransportError,
)
from guest_client.retry import RetryPolicy

__all__ = [
    "ConfigurationError",
    "EffectUnknown",
    "GuestEnvironment",
    "HostClient",
    "HostcallError",
    "ProtocolError",
    "Refused",
    "ResultInvalid",
    "RetryPolicy",
    "ToolError",
    "TransportError",
    "connect",
]
