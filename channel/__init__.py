"""The Unix-socket HTTP transport between guests and their brokers (SPEC §4)."""

from __future__ import annotations

from channel.errors import ERROR_STATUS, HostcallError, Refusal, http_status_for
from channel.routing import BrokerPort, ExecutionDirectory, ExecutionPort
from channel.server import DEFAULT_MAX_BODY, ChannelServer
from channel.wire import CallReply, CallRequest, is_valid_id, parse_call_request

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
