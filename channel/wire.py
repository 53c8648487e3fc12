"""Wire models: the request body a guest sends and the reply it gets (docs/protocol.md).

Untrusted bytes become typed data here, and only here: strict JSON first
(duplicate keys and NaN/Infinity refused at any depth), then a pydantic model
that refuses unknown top-level fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from json.encoder import (  # type: ignore[attr-defined]  # the C encoder has no stub
    c_make_encoder,
    encode_basestring_ascii,
)
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from channel.errors import Refusal, http_status_for
from channel.frozen import fast_init
from channel.ids import CALL_ID_PATTERN, is_valid_id

__all__ = [
    "CALL_ID_PATTERN",
    "MAX_TOOL_NAME",
    "CallReply",
    "CallRequest",
    "Effect",
    "ReplyStatus",
    "compact_json",
    "is_tool_name",
    "is_valid_id",
    "parse_call_request",
    "parse_strict_json",
]

#: The longest tool name a request (or a plan) may use.
MAX_TOOL_NAME: Final = 256

Effect = Literal["executed", "replayed", "none", "unknown", "failed"]
ReplyStatus = Literal["ok", "ambiguous", "refused", "error", "awaiting_approval"]


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # rare: find the first key seen twice, for the message
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return obj


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    # json parses 1e400 to inf without asking parse_constant: refuse it as
    # Infinity (an idempotency key must not make inf and null one input).
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:32]} is not a finite number")
    return value


# Made once, not per call as json.loads/json.dumps with options do: both are
# reentrant, and every request and reply goes through them.
_strict_decode: Final = json.JSONDecoder(
    object_pairs_hook=_refuse_duplicates,
    parse_constant=_refuse_constant,
    parse_float=_finite_float,
).decode


def _compact_json() -> Callable[[Any], str]:
    """``json.dumps(value, separators=(",", ":"))`` without its per-call set-up:
    json's C encoder made once (as ``supervisor.canonical.c_json_encoder``,
    which the channel does not import). A cycle raises ``RecursionError``."""
    reference = json.JSONEncoder(separators=(",", ":"))
    if c_make_encoder is None:  # an interpreter without json's C accelerator
        return reference.encode
    chunks = c_make_encoder(
        None, reference.default, encode_basestring_ascii, None, ":", ",", False, False, True
    )

    def encode(value: Any) -> str:
        return "".join(chunks(value, 0))

    return encode


#: ``json.dumps(value, separators=(",", ":"))``: ASCII-only compact JSON.
compact_json: Final = _compact_json()


def parse_strict_json(raw: bytes) -> Any:
    """Parse RFC 8259 JSON, refusing duplicate keys and NaN/Infinity (also
    as a number too large for a double, such as ``1e400``).

    Raises:
        Refusal: ``bad_request`` when the bytes are not strict JSON.
    """
    try:
        return _strict_decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refusal("bad_request", f"body is not valid JSON: {exc}") from None


class CallRequest(BaseModel):
    """Body of ``POST /v1/calls``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    call_id: StrictStr
    tool: StrictStr
    args: dict[str, Any]


def parse_call_request(raw: bytes) -> CallRequest:
    """Turn a request body into a :class:`CallRequest`.

    Raises:
        Refusal: ``bad_request`` for bad JSON, unknown or missing fields, a
            non-object ``args`` or a malformed ``call_id``.
    """
    data = parse_strict_json(raw)
    if not isinstance(data, dict):
        raise Refusal("bad_request", "body must be a JSON object")
    try:
        # strict=True: "args" must already be an object, no coercion of ids.
        request = CallRequest.model_validate(data, strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise Refusal("bad_request", f"malformed call: {problems}") from None
    if not is_valid_id(request.call_id):
        raise Refusal("bad_request", "call_id must be 1-128 characters of [A-Za-z0-9._:-]")
    if not is_tool_name(request.tool):
        # It is echoed in the reply, the receipt and the console: bounded text.
        raise Refusal("bad_request", f"tool must be 1-{MAX_TOOL_NAME} characters of text")
    return request


def is_tool_name(name: str) -> bool:
    """Whether ``name`` can name a tool: 1 to :data:`MAX_TOOL_NAME` characters
    of text (no lone surrogates, so it can be written as UTF-8)."""
    if not 0 < len(name) <= MAX_TOOL_NAME:
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@fast_init
@dataclass(frozen=True, slots=True)
class CallReply:
    """What a guest gets back for one request; maps 1:1 to the JSON body."""

    status: ReplyStatus
    call_id: str | None
    effect: Effect
    tool: str | None = None
    result: Any = None
    idempotency_key: str | None = None
    receipt_id: str | None = None
    reason: str | None = None
    error: Mapping[str, Any] | None = None

    @classmethod
    def refused(
        cls,
        call_id: str | None,
        refusal: Refusal,
        *,
        tool: str | None = None,
        idempotency_key: str | None = None,
    ) -> CallReply:
        """The reply for a refusal: nothing ran for this request."""
        error: dict[str, Any] = {"code": refusal.code, "message": refusal.message}
        if refusal.details is not None:
            error["details"] = refusal.details
        return cls(
            status="refused",
            call_id=call_id,
            effect="none",
            tool=tool,
            idempotency_key=idempotency_key,
            error=error,
        )

    @classmethod
    def ambiguous(
        cls, call_id: str, tool: str, reason: Literal["in_flight", "unknown"], key: str
    ) -> CallReply:
        """The reply for a call whose effect may have happened."""
        return cls(
            status="ambiguous",
            call_id=call_id,
            effect="unknown",
            tool=tool,
            reason=reason,
            idempotency_key=key,
        )

    @property
    def http_status(self) -> int:
        """The HTTP status this reply is sent with (docs/protocol.md, "What a response means")."""
        if self.status == "ok":
            return 200
        if self.status == "ambiguous":
            return 409
        if self.status == "awaiting_approval":
            return 202
        assert self.error is not None
        return http_status_for(str(self.error["code"]))

    def as_replayed(self) -> CallReply:
        """The same stored reply, marked as replayed (nothing ran now)."""
        return self._with(effect="replayed", receipt_id=self.receipt_id)

    def with_receipt(self, receipt_id: str) -> CallReply:
        """The same reply, naming this request's receipt."""
        return self._with(effect=self.effect, receipt_id=receipt_id)

    def _with(self, *, effect: Effect, receipt_id: str | None) -> CallReply:
        # Positional and explicit: dataclasses.replace showed in the hot path.
        return CallReply(
            self.status,
            self.call_id,
            effect,
            self.tool,
            self.result,
            self.idempotency_key,
            receipt_id,
            self.reason,
            self.error,
        )

    def to_bytes(self) -> bytes:
        """The JSON body, encoded."""
        return compact_json(self.to_json()).encode()

    def to_json(self) -> dict[str, Any]:
        """The JSON body. ``result`` appears on ``ok`` only, ``error`` on failures."""
        body: dict[str, Any] = {"status": self.status, "call_id": self.call_id}
        if self.tool is not None:
            body["tool"] = self.tool
        body["effect"] = self.effect
        if self.status == "ok":
            body["result"] = self.result
        if self.reason is not None:
            body["reason"] = self.reason
        if self.error is not None:
            body["error"] = dict(self.error)
        if self.idempotency_key is not None:
            body["idempotency_key"] = self.idempotency_key
        if self.receipt_id is not None:
            body["receipt_id"] = self.receipt_id
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CallReply:
        """Rebuild a reply from :meth:`to_json` output (a stored response)."""
        return cls(
            status=body["status"],
            call_id=body.get("call_id"),
            effect=body["effect"],
            tool=body.get("tool"),
            result=body.get("result"),
            idempotency_key=body.get("idempotency_key"),
            receipt_id=body.get("receipt_id"),
            reason=body.get("reason"),
            error=body.get("error"),
        )
