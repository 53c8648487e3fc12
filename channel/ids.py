"""The one id syntax of the wire (docs/protocol.md, "Endpoints"), importable without the rest."""

from __future__ import annotations

import re
from typing import Final

__all__ = ["CALL_ID_PATTERN", "is_valid_id"]

#: docs/protocol.md, "Endpoints": call ids and every id the CLI accepts.
CALL_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,128}$"
_ID_RE: Final = re.compile(CALL_ID_PATTERN)


def is_valid_id(value: str) -> bool:
    """Whether ``value`` is a well-formed call, invocation or execution id."""
    return _ID_RE.fullmatch(value) is not None
