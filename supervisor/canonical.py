"""Canonical JSON (RFC 8785, JCS) and the hashes built on it."""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable
from json.encoder import (  # type: ignore[attr-defined]  # the C encoder has no stub
    c_make_encoder,
    encode_basestring,
    encode_basestring_ascii,
)
from typing import Any, Final

import rfc8785

__all__ = [
    "MAX_NESTING",
    "c_json_encoder",
    "compact_json",
    "idempotency_key",
    "idempotency_key_sized",
    "jcs",
    "nested_deeper_than",
    "sha256_hex",
]

#: JCS numbers are IEEE doubles: integers beyond this lose precision.
_MAX_SAFE_INT: Final = 2**53 - 1


def c_json_encoder(*, sort_keys: bool, ensure_ascii: bool, allow_nan: bool) -> Callable[[Any], str]:
    """``json.JSONEncoder(separators=(",", ":"), …).encode`` without its per-call
    set-up: json's C encoder, made once. The same text for every value
    (a property test checks it), but for a cycle: no cycle check, so one
    raises ``RecursionError`` (``json.dumps``: ``ValueError``), as a value
    nested too deep does in both. Reentrant: it keeps no state between calls.
    """
    reference = json.JSONEncoder(
        separators=(",", ":"), sort_keys=sort_keys, ensure_ascii=ensure_ascii, allow_nan=allow_nan
    )
    if c_make_encoder is None:  # an interpreter without json's C accelerator
        return reference.encode
    quote = encode_basestring_ascii if ensure_ascii else encode_basestring
    chunks = c_make_encoder(
        None, reference.default, quote, None, ":", ",", sort_keys, False, allow_nan
    )

    def encode(value: Any) -> str:
        return "".join(chunks(value, 0))

    return encode


#: JCS's writer once :func:`_fast_form` vouched for the value.
_encode: Final = c_json_encoder(sort_keys=True, ensure_ascii=False, allow_nan=False)

#: ``json.dumps(value, separators=(",", ":"))``: a stored response is written
#: with it on every call. The channel has its own (``channel.wire.compact_json``):
#: it imports nothing of the supervisor.
compact_json: Final = c_json_encoder(sort_keys=False, ensure_ascii=True, allow_nan=True)


class _Form(enum.Enum):
    """How :func:`jcs` may write a value."""

    #: Only the ``rfc8785`` package writes it as JCS.
    SLOW = enum.auto()
    #: :mod:`json`'s C encoder writes it as JCS.
    AS_IS = enum.auto()
    #: :mod:`json`'s C encoder writes it as JCS once integral floats are ints.
    WITH_INTS = enum.auto()


#: Floats ``repr`` writes as JCS (ECMAScript) does, when not integral: both
#: write the shortest round-trip digits, the closest of them (ECMAScript
#: recommends it and engines do it; ``repr`` always does), positionally in
#: this range.
_REPR_MIN: Final = 1e-4
_REPR_MAX: Final = 1e16


def _fast_form(value: Any) -> _Form:
    """Whether :mod:`json` serializes ``value`` exactly as JCS does: it holds
    only ASCII keys (sorted the same by code point and by UTF-16 unit),
    strings, booleans, ``None``, safe integers, and floats whose ``repr`` is
    ECMAScript's — in ``[1e-4, 1e16)`` — or that are integral (JCS ``1``
    where ``repr`` says ``1.0``: :attr:`_Form.WITH_INTS`).

    Exact types only (a subclass may serialize differently: it takes the
    reference path), walked with a stack: this runs for every call's
    arguments, result and receipt. A container met twice (shared, or a cycle
    a handler's result may hold) takes the reference path too, which writes
    a shared one twice and refuses a cycle.
    """
    form = _Form.AS_IS
    seen: set[int] = set()
    stack = [value]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        item = pop()
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if -_MAX_SAFE_INT <= item <= _MAX_SAFE_INT:
                continue
            return _Form.SLOW
        if kind is float:
            if item.is_integer():  # False for NaN and the infinities
                if -_MAX_SAFE_INT <= item <= _MAX_SAFE_INT:
                    form = _Form.WITH_INTS
                    continue
                return _Form.SLOW
            if _REPR_MIN <= abs(item) < _REPR_MAX:
                continue
            return _Form.SLOW
        if kind is not dict and kind is not list:
            return _Form.SLOW
        if id(item) in seen:
            return _Form.SLOW
        seen.add(id(item))
        if kind is list:
            extend(item)
            continue
        for key, inner in item.items():
            if type(key) is not str or not key.isascii():
                return _Form.SLOW
            kind = type(inner)
            if kind is str or inner is None or kind is bool:
                continue  # the usual leaf, without a trip through the stack
            push(inner)
    return form


def _with_ints(value: Any) -> Any:
    """``value`` with every integral float an int (a value :func:`_fast_form`
    walked: exact dicts and lists, none met twice, and scalars)."""
    kind = type(value)
    if kind is float:
        return int(value) if value.is_integer() else value
    if kind is dict:
        return {key: _with_ints(inner) for key, inner in value.items()}
    if kind is list:
        return [_with_ints(inner) for inner in value]
    return value


#: The deepest nesting of arrays and objects a result may have: about where
#: pydantic's serializer stops (it refuses 255 levels), which bounds tools with
#: an output schema and JSON-typed arguments already. Well inside the
#: interpreter's recursion limit, so a result accepted once is written,
#: stored, read back and hashed again on any later path.
MAX_NESTING: Final = 255


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` holds arrays or objects more than ``limit`` levels deep.

    Walked a level at a time, so the answer never depends on how deep the
    caller's own stack is. A container held in several places is walked in
    each, as JCS writes it: call this on a value :func:`jcs` accepted (it
    refuses cycles), and it costs no more than that JCS did.
    """
    level = [value]
    for _ in range(limit + 1):  # the items of ``level`` are inside that many containers
        inner: list[Any] = []
        extend = inner.extend
        containers = False
        for item in level:
            if isinstance(item, dict):
                containers = True
                extend(item.values())
            elif isinstance(item, (list, tuple)):
                containers = True
                extend(item)
        if not containers:
            return False
        level = inner
    return True


def jcs(value: Any) -> bytes:
    """Serialize ``value`` with the JSON Canonicalization Scheme (RFC 8785).

    The common case (ASCII keys, everyday numbers) takes :mod:`json`'s C
    encoder, whose output is then byte-for-byte JCS (a property test checks
    it against the ``rfc8785`` package); everything else goes through
    ``rfc8785``, several times slower.

    Raises:
        ValueError: ``value`` is not JSON (a set, a NaN, an integer past 2**53,
            a lone surrogate …).
    """
    try:
        form = _fast_form(value)
        if form is not _Form.SLOW:
            try:
                plain = value if form is _Form.AS_IS else _with_ints(value)
                return _encode(plain).encode("utf-8")
            except RecursionError:
                pass  # nested deeper than these recurse: rfc8785 decides
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError, UnicodeEncodeError, RecursionError) as exc:
        raise ValueError(f"not canonical JSON: {exc}") from exc


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def idempotency_key(tool: str, canonical_args: Any) -> str:
    """docs/protocol.md, step 4: ``sha256(JCS({"tool": name, "args": canonical_args}))`` in hex.

    The same business input gives the same key whatever the ``call_id``.
    """
    return idempotency_key_sized(tool, canonical_args)[0]


def idempotency_key_sized(tool: str, canonical_args: Any) -> tuple[str, int]:
    """:func:`idempotency_key`, and the length of the JCS it hashed."""
    data = jcs({"tool": tool, "args": canonical_args})
    return sha256_hex(data), len(data)
