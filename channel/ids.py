"""The one id syntax of the wire (docs/protocol.md, "Endpoints"), importable without the rest."""

from __future__ import annotations

import re
from typing import Final

__all__ = ["CALL_ID_PATTERN", "is_path_safe_id", "is_valid_id"]

#: docs/protocol.md, "Endpoints": call ids and every id the CLI accepts.
CALL_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,128}$"
_ID_RE: Final = re.compile(CALL_ID_PATTERN)


def is_valid_id(value: str) -> bool:
    """Whether ``value`` is a well-formed call, invocation or execution id."""
    return _ID_RE.fullmatch(value) is not None


def is_path_safe_id(value: str) -> bool:
    """A well-formed id that is also safe as one path component: not ``.`` or
    ``..`` (the id syntax allows both; an invocation id names its receipt
    file and its log folder)."""
    return is_valid_id(value) and value not in (".", "..")
