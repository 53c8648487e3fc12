"""The OpenAPI 3.1 document of the guest protocol (docs/protocol.md).

Built from the channel's own tables - the error codes and their HTTP statuses
(:data:`channel.errors.ERROR_STATUS`), the id pattern, the longest long-poll -
so the document cannot drift from what the server sends. The channel serves
it at ``GET /v1/openapi.json``; ``channel/openapi.json`` is the same document,
committed for readers and code generators in any language. A test checks
that it is current; regenerate it with::

    python -c 'import channel.openapi as o, sys; sys.stdout.buffer.write(o.document_bytes())' \
        > channel/openapi.json

Schemas are JSON Schema 2020-12, as OpenAPI 3.1 specifies. Response bodies are
closed (``additionalProperties: false``) so that a conformance test catches an
undocumented field; ``result`` and the tools' own schemas are open.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any, Final

from channel.errors import ERROR_STATUS
from channel.wire import CALL_ID_PATTERN, MAX_TOOL_NAME

__all__ = ["OPENAPI_PATH", "OPERATION_CODES", "document", "document_bytes"]

#: Where the channel serves the document.
OPENAPI_PATH: Final = "/v1/openapi.json"
#: ``channel.server.MAX_WAIT_S``, which cannot be imported here (the server
#: imports this module); a test checks that the two agree.
_MAX_WAIT_S: Final = 60

_IDENTITY_CODES: Final = ("unauthenticated", "plan_mismatch", "execution_fenced", "origin_denied")
#: Answered to a new connection over its execution's limit, whatever it asks
#: (docs/security.md, S9); origin_denied, too, to one whose process cannot be attributed.
_CONNECTION_CODES: Final = ("too_many_connections",)

#: The error codes each operation can answer with, besides its successes.
OPERATION_CODES: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    ("post", "/v1/calls"): (
        "bad_request",
        *_IDENTITY_CODES,
        "tool_not_allowed",
        "approval_rejected",
        "approval_expired",
        "cancelled",
        "payload_too_large",
        "unsupported_media_type",
        "invalid_arguments",
        "target_required",
        "call_id_reused",
        "budget_exhausted",
        "tool_error",
        "result_invalid",
        "internal_error",
        "store_unavailable",
        *_CONNECTION_CODES,
    ),
    ("get", "/v1/calls/{call_id}"): (
        "bad_request",
        *_IDENTITY_CODES,
        "not_found",
        "result_invalid",
        "internal_error",
        *_CONNECTION_CODES,
    ),
    ("get", "/v1/plan"): (*_IDENTITY_CODES, "internal_error", *_CONNECTION_CODES),
    ("get", OPENAPI_PATH): (*_IDENTITY_CODES, "internal_error", *_CONNECTION_CODES),
}

# Error codes whose body has status "error" rather than "refused".
_ERROR_CODES: Final = frozenset({"tool_error", "result_invalid", "internal_error"})

_KEY: Final = {"type": "string", "pattern": "^[0-9a-f]{64}$", "description": "sha256 hex"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _schemas() -> dict[str, Any]:
    call_id = {"type": "string", "pattern": CALL_ID_PATTERN}
    nullable_call_id = {"type": ["string", "null"], "pattern": CALL_ID_PATTERN}
    return {
        "CallId": {
            **call_id,
            "description": "Names one call within an invocation; the host runs it at most once.",
        },
        "CallRequest": {
            "type": "object",
            "required": ["call_id", "tool", "args"],
            "additionalProperties": False,
            "properties": {
                "call_id": _ref("CallId"),
                "tool": {"type": "string", "minLength": 1, "maxLength": MAX_TOOL_NAME},
                "args": {
                    "type": "object",
                    "description": "The tool's arguments; checked against its input_schema.",
                },
            },
        },
        "Ok": {
            "type": "object",
            "description": "The tool ran for this request (executed) or earlier (replayed).",
            "required": ["status", "call_id", "tool", "effect", "result", "idempotency_key"],
            "additionalProperties": False,
            "properties": {
                "status": {"const": "ok"},
                "call_id": _ref("CallId"),
                "tool": {"type": "string"},
                "effect": {"enum": ["executed", "replayed"]},
                "result": {"description": "The tool's result, valid against its output_schema."},
                "idempotency_key": _KEY,
                "receipt_id": {
                    "type": "string",
                    "description": "The receipt of this request (POST only).",
                },
            },
        },
        "Ambiguous": {
            "type": "object",
            "description": (
                "The tool may be running (in_flight: poll GET /v1/calls/{call_id}?wait=) "
                "or may have taken effect (unknown: do not retry under a new call_id)."
            ),
            "required": ["status", "call_id", "tool", "effect", "reason", "idempotency_key"],
            "additionalProperties": False,
            "properties": {
                "status": {"const": "ambiguous"},
                "call_id": _ref("CallId"),
                "tool": {"type": "string"},
                "effect": {"const": "unknown"},
                "reason": {"enum": ["in_flight", "unknown"]},
                "idempotency_key": _KEY,
            },
        },
        "AwaitingApproval": {
            "type": "object",
            "description": "The call waits for an operator's decision; nothing ran yet.",
            "required": ["status", "call_id", "tool", "effect", "idempotency_key"],
            "additionalProperties": False,
            "properties": {
                "status": {"const": "awaiting_approval"},
                "call_id": _ref("CallId"),
                "tool": {"type": "string"},
                "effect": {"const": "none"},
                "idempotency_key": _KEY,
            },
        },
        "Problem": {
            "type": "object",
            "description": "One reason the arguments fail the tool's input schema.",
            "required": ["loc", "msg"],
            "additionalProperties": False,
            "properties": {
                "loc": {"type": "array", "items": {"type": ["string", "integer"]}},
                "msg": {"type": "string"},
            },
        },
        "Refused": {
            "type": "object",
            "description": "The request was refused: the tool was not called for it.",
            "required": ["status", "call_id", "effect", "error"],
            "additionalProperties": False,
            "properties": {
                "status": {"const": "refused"},
                "call_id": nullable_call_id,
                "tool": {"type": "string"},
                "effect": {"const": "none"},
                "idempotency_key": _KEY,
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "additionalProperties": False,
                    "properties": {
                        "code": {"type": "string"},
                        "message": {"type": "string"},
                        "details": {"type": "array", "items": _ref("Problem")},
                    },
                },
            },
        },
        "ToolError": {
            "type": "object",
            "description": (
                "The tool ran and raised; nothing is in doubt and the record was "
                "released, so the call may be made again."
            ),
            "required": ["status", "call_id", "tool", "effect", "error"],
            "additionalProperties": False,
            "properties": {
                "status": {"const": "error"},
                "call_id": _ref("CallId"),
                "tool": {"type": "string"},
                "effect": {"const": "failed"},
                "idempotency_key": _KEY,
                "error": {
                    "type": "object",
                    "required": ["code", "type", "message"],
                    "additionalProperties": False,
                    "properties": {
                        "code": {"const": "tool_error"},
                        "type": {"type": "string"},
                        "message": {"type": "string"},
                    },
                },
            },
        },
        "ResultInvalid": {
            "type": "object",
            "description": (
                "The tool ran and its effect happened, but its result fails the "
                "output schema. Committed: the same call_id replays this answer."
            ),
            "required": ["status", "call_id", "tool", "effect", "error", "idempotency_key"],
            "additionalProperties": False,
            "properties": {
                "status": {"const": "error"},
                "call_id": _ref("CallId"),
                "tool": {"type": "string"},
                "effect": {"enum": ["executed", "replayed"]},
                "idempotency_key": _KEY,
                "receipt_id": {"type": "string"},
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "additionalProperties": False,
                    "properties": {
                        "code": {"const": "result_invalid"},
                        "message": {"type": "string"},
                    },
                },
            },
        },
        "InternalError": {
            "type": "object",
            "description": "The channel failed; whether the tool ran is not known.",
            "required": ["status", "call_id", "effect", "error"],
            "additionalProperties": False,
            "properties": {
                "status": {"const": "error"},
                "call_id": {"type": "null"},
                "effect": {"const": "unknown"},
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "additionalProperties": False,
                    "properties": {
                        "code": {"const": "internal_error"},
                        "message": {"type": "string"},
                    },
                },
            },
        },
        "Tool": {
            "type": "object",
            "required": [
                "name",
                "description",
                "input_schema",
                "output_schema",
                "reversibility",
                "approval",
                "cost",
            ],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "input_schema": {"type": "object", "description": "A JSON Schema."},
                "output_schema": {
                    "type": ["object", "null"],
                    "description": "A JSON Schema, or null when the result is not constrained.",
                },
                "reversibility": {"enum": ["reversible", "costly", "irreversible"]},
                "approval": {"enum": ["never", "always"]},
                "cost": {"type": "number", "minimum": 0},
            },
        },
        "Budget": {
            "type": "object",
            "description": "What is left of the invocation's budget; null where no limit is set.",
            "required": ["max_calls", "calls_left", "max_cost", "cost_left", "deadline_at"],
            "additionalProperties": False,
            "properties": {
                "max_calls": {"type": ["integer", "null"], "minimum": 0},
                "calls_left": {"type": ["integer", "null"], "minimum": 0},
                "max_cost": {"type": ["number", "null"], "minimum": 0},
                "cost_left": {"type": ["number", "null"], "minimum": 0},
                "deadline_at": {
                    "type": ["number", "null"],
                    "description": "Unix time, in seconds, after which calls are refused.",
                },
            },
        },
        "Plan": {
            "type": "object",
            "required": ["plan_hash", "name", "tools", "budget"],
            "additionalProperties": False,
            "properties": {
                "plan_hash": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
                "name": {"type": "string"},
                "tools": {"type": "array", "items": _ref("Tool")},
                "budget": _ref("Budget"),
                "approval_timeout_s": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "description": (
                        "How long a proposal waits for a decision: a call of a tool whose "
                        "approval is always may take that long to answer."
                    ),
                },
            },
        },
    }


def _by_status(codes: Iterable[str]) -> dict[int, list[str]]:
    grouped: dict[int, list[str]] = {}
    for code in codes:
        grouped.setdefault(ERROR_STATUS[code], []).append(code)
    return grouped


def _failure_schema(codes: list[str]) -> dict[str, Any]:
    """The body of a response with one HTTP status, for the codes it may carry."""
    options: list[dict[str, Any]] = []
    refusals = [code for code in codes if code not in _ERROR_CODES]
    if refusals:
        options.append(
            {
                "allOf": [
                    _ref("Refused"),
                    {"properties": {"error": {"properties": {"code": {"enum": refusals}}}}},
                ]
            }
        )
    options.extend(_ref(_ERROR_SCHEMAS[code]) for code in codes if code in _ERROR_CODES)
    return options[0] if len(options) == 1 else {"oneOf": options}


_ERROR_SCHEMAS: Final = {
    "tool_error": "ToolError",
    "result_invalid": "ResultInvalid",
    "internal_error": "InternalError",
}

_DESCRIPTIONS: Final = {
    200: "Executed, or replayed from a committed record.",
    202: "The call's proposal waits for an operator's decision.",
    400: "Malformed frame, call_id or JSON.",
    401: "Identity: missing or wrong credential, or wrong invocation.",
    403: "Identity, origin, a tool not in the plan, or an operator's refusal.",
    404: "No record of this call.",
    409: "The outcome is in doubt (ambiguous), or the execution was cancelled.",
    413: "Body over the limit (1 MiB by default).",
    415: "Content-Type is not application/json.",
    422: "Arguments fail the schema, a target is missing, or the call_id was reused.",
    429: "The invocation's budget would be exceeded.",
    500: "The tool raised, its result is invalid, or the channel failed.",
    503: (
        "The effect store is unavailable, or the execution has too many open "
        "connections (the connection is closed); nothing ran."
    ),
}


def _responses(
    method: str, path: str, successes: dict[int, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    statuses: dict[int, dict[str, Any]] = dict(successes)
    for status, codes in _by_status(OPERATION_CODES[(method, path)]).items():
        schema = _failure_schema(codes)
        if status in statuses:  # 409 of a call: ambiguous, or a cancelled refusal
            schema = {"oneOf": [statuses[status], schema]}
        statuses[status] = schema
    return {
        str(status): _json(statuses[status], _DESCRIPTIONS[status]) for status in sorted(statuses)
    }


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the guest protocol, as a fresh dict."""
    identity = [{"$ref": f"#/components/parameters/{name}"} for name in _HEADER_PARAMETERS]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "hostcall guest channel",
            "version": "1",
            "summary": "How a guest process calls host tools, at most once per call_id.",
            "description": (
                "HTTP/1.1 over the Unix socket named by HOSTCALL_SOCKET (the host part "
                "of the URL is ignored). Every request carries the four identity headers; "
                "identity is checked before anything else. Every body has `status` and "
                "`effect`: read `effect` to know whether the tool may have run. See "
                "docs/protocol.md and docs/guests.md."
            ),
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [
            {"url": "http://localhost", "description": "The channel socket (HOSTCALL_SOCKET)."}
        ],
        "security": [{"credential": []}],
        "paths": {
            "/v1/calls": {
                "post": {
                    "operationId": "makeCall",
                    "summary": "Make a call; a retry with the same call_id never runs it twice.",
                    "parameters": identity,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("CallRequest")}},
                    },
                    "responses": _responses(
                        "post",
                        "/v1/calls",
                        {200: _ref("Ok"), 409: _ref("Ambiguous")},
                    ),
                }
            },
            "/v1/calls/{call_id}": {
                "get": {
                    "operationId": "getCall",
                    "summary": "The state of a call, without running anything.",
                    "parameters": [
                        *identity,
                        {
                            "name": "call_id",
                            "in": "path",
                            "required": True,
                            "schema": _ref("CallId"),
                        },
                        {
                            "name": "wait",
                            "in": "query",
                            "required": False,
                            "description": "Long-poll up to this many seconds while in flight.",
                            "schema": {"type": "number", "minimum": 0, "maximum": _MAX_WAIT_S},
                        },
                    ],
                    "responses": _responses(
                        "get",
                        "/v1/calls/{call_id}",
                        {
                            200: _ref("Ok"),
                            202: _ref("AwaitingApproval"),
                            409: _ref("Ambiguous"),
                        },
                    ),
                }
            },
            "/v1/plan": {
                "get": {
                    "operationId": "getPlan",
                    "summary": "The plan as the guest sees it, with the budget left.",
                    "parameters": identity,
                    "responses": _responses("get", "/v1/plan", {200: _ref("Plan")}),
                }
            },
            OPENAPI_PATH: {
                "get": {
                    "operationId": "getOpenAPI",
                    "summary": "This document.",
                    "parameters": identity,
                    "responses": _responses(
                        "get",
                        OPENAPI_PATH,
                        {200: {"type": "object", "required": ["openapi", "paths"]}},
                    ),
                }
            },
        },
        "components": {
            "securitySchemes": {
                "credential": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": (
                        "The execution's credential, read once from the fd named by "
                        "HOSTCALL_CREDENTIAL_FD (or from HOSTCALL_CREDENTIAL)."
                    ),
                }
            },
            "parameters": {
                name: {
                    "name": header,
                    "in": "header",
                    "required": True,
                    "description": f"From {variable}.",
                    "schema": {"type": "string"},
                }
                for name, (header, variable) in _HEADER_PARAMETERS.items()
            },
            "schemas": _schemas(),
        },
    }


_HEADER_PARAMETERS: Final = {
    "Invocation": ("Hostcall-Invocation", "HOSTCALL_INVOCATION"),
    "Execution": ("Hostcall-Execution", "HOSTCALL_EXECUTION"),
    "Plan": ("Hostcall-Plan", "HOSTCALL_PLAN"),
}


@functools.cache
def document_bytes() -> bytes:
    """The document as the channel serves it and ``channel/openapi.json`` holds it."""
    return (json.dumps(document(), indent=2) + "\n").encode()
