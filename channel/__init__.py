"""The Unix-socket HTTP transport between guests and their brokers (docs/protocol.md).

Names are loaded on first use (PEP 562): importing ``channel.errors`` or
``channel.ids`` alone does not load the server and aiohttp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from channel.errors import ERROR_STATUS, HostcallError, Refusal, http_status_for
    from channel.ids import is_valid_id
    from channel.routing import BrokerPort, ExecutionDirectory, ExecutionPort
    from channel.server import DEFAULT_MAX_BODY, ChannelServer
    from channel.wire import CallReply, CallRequest, parse_call_request

__all__ = [
    "DEFAULT_MAX_BODY",
    "ERROR_STATUS",
    "BrokerPort",
    "CallReply",
    "CallRequest",
    "ChannelServer",
    "ExecutionDirectory",
    "ExecutionPort",
    "HostcallError",
    "Refusal",
    "http_status_for",
    "is_valid_id",
    "parse_call_request",
]

_WHERE = {
    "ERROR_STATUS": "channel.errors",
    "HostcallError": "channel.errors",
    "Refusal": "channel.errors",
    "http_status_for": "channel.errors",
    "is_valid_id": "channel.ids",
    "BrokerPort": "channel.routing",
    "ExecutionDirectory": "channel.routing",
    "ExecutionPort": "channel.routing",
    "DEFAULT_MAX_BODY": "channel.server",
    "ChannelServer": "channel.server",
    "CallReply": "channel.wire",
    "CallRequest": "channel.wire",
    "parse_call_request": "channel.wire",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'channel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
