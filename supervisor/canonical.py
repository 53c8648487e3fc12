"""Canonical JSON (RFC 8785, JCS) and the hashes built on it."""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785

__all__ = ["idempotency_key", "jcs", "sha256_hex"]


def jcs(value: Any) -> bytes:
    """Serialize ``value`` with the JSON Canonicalization Scheme (RFC 8785).

    Raises:
        ValueError: ``value`` is not JSON (a set, a NaN, an integer past 2**53 …).
    """
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError) as exc:
        raise ValueError(f"not canonical JSON: {exc}") from exc


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def idempotency_key(tool: str, canonical_args: Any) -> str:
    """SPEC §5.4: ``sha256(JCS({"tool": name, "args": canonical_args}))`` in hex.

    The same business input gives the same key whatever the ``call_id``.
    """
    return sha256_hex(jcs({"tool": tool, "args": canonical_args}))
