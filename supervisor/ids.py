"""Identifiers: invocation, execution, receipt and proposal ids, credentials."""

from __future__ import annotations

import base64
import hashlib
import secrets

from channel.ids import is_path_safe_id, is_valid_id

__all__ = ["is_path_safe_id", "is_valid_id", "mint_credential", "new_id"]


def new_id(prefix: str) -> str:
    """A fresh random id such as ``inv_3q…`` (valid per docs/protocol.md, "Endpoints")."""
    return f"{prefix}_{secrets.token_hex(12)}"


def mint_credential() -> tuple[str, bytes]:
    """A new execution credential and its SHA-256 (docs/protocol.md).

    Returns the credential (32 random bytes, base64url without padding), which
    goes to the guest and is then forgotten, and the digest, which is kept.
    """
    token = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=")
    return token.decode("ascii"), hashlib.sha256(token).digest()
