"""The canonical JSON fast path must be byte-for-byte RFC 8785."""

from __future__ import annotations

from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.canonical import jcs

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_keys = st.text(max_size=8) | st.sampled_from(["a", "b", "é", "\U0001f600", "\ue000", "Z"])
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=20,
)


def _reference(value: Any) -> bytes | None:
    try:
        return rfc8785.dumps(value)
    except Exception:
        return None


@settings(max_examples=500, deadline=None)
@given(json_values)
def test_jcs_agrees_with_the_rfc8785_package_on_any_json(value: Any) -> None:
    expected = _reference(value)
    if expected is None:
        with pytest.raises(ValueError, match="not canonical JSON"):
            jcs(value)
    else:
        assert jcs(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        {"\x00ctl": '\x1f\b\t\n\f\r"\\\x7f\u2028'},
        {"b": 1, "a": [True, None, "é"], "c": {"z": -(2**53) + 1}},
        ["\ud800"],
        {"big": 2**53},
        {"float": 1.0, "small": 1e-7, "large": 1e21},
        {1: "non-string key"},
        {"nested": [[[]], {}]},
    ],
)
def test_jcs_agrees_with_the_rfc8785_package_on_the_edges(value: Any) -> None:
    expected = _reference(value)
    if expected is None:
        with pytest.raises(ValueError, match="not canonical JSON"):
            jcs(value)
    else:
        assert jcs(value) == expected
