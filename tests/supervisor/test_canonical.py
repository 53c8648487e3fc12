"""The canonical JSON fast path must be byte-for-byte RFC 8785."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from channel.wire import compact_json as channel_compact_json
from supervisor.canonical import c_json_encoder, compact_json, jcs, nested_deeper_than

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


def _assert_jcs_agrees(value: Any) -> None:
    """``jcs`` gives the rfc8785 package's bytes, or refuses where it does."""
    try:
        expected = rfc8785.dumps(value)
    except Exception:
        with pytest.raises(ValueError, match="not canonical JSON"):
            jcs(value)
    else:
        assert jcs(value) == expected


@settings(max_examples=500, deadline=None)
@given(json_values)
def test_jcs_agrees_with_the_rfc8785_package_on_any_json(value: Any) -> None:
    _assert_jcs_agrees(value)


#: Floats where ``repr`` and ECMAScript part ways, or nearly: the fast path's bounds.
_EDGE_FLOATS = [
    0.0,
    -0.0,
    1e-4,
    9.999999999999999e-05,
    -1e-4,
    1e16,
    9999999999999998.0,
    1e16 - 2,
    float(2**53),
    float(2**53 - 1),
    -float(2**53 - 1),
    float(2**53 + 2),
    4503599627370495.5,
    1e15 + 0.5,
    0.1,
    12.5,
    -7.25,
    5e-324,
    1.7976931348623157e308,
    1e21,
    1e-7,
]


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(
        st.floats(allow_nan=False, allow_infinity=False)
        | st.floats(min_value=1e-5, max_value=1e17)
        | st.sampled_from(_EDGE_FLOATS)
        | st.integers(min_value=-(2**53), max_value=2**53).map(float),
        max_size=6,
    )
)
def test_jcs_agrees_with_the_rfc8785_package_on_floats(value: list[float]) -> None:
    assert jcs({"amounts": value}) == rfc8785.dumps({"amounts": value})


@pytest.mark.parametrize("number", _EDGE_FLOATS)
def test_jcs_agrees_with_the_rfc8785_package_on_edge_floats(number: float) -> None:
    for value in (number, [number], {"n": number}, {"n": [{"m": number}]}):
        assert jcs(value) == rfc8785.dumps(value)


def test_everyday_float_arguments_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # rfc8785's pure-Python encoder costs several times json's C encoder; a
    # refund of 12.5 (or of 10, which pydantic makes 10.0) must not pay it.
    def general_path(value: Any) -> bytes:
        raise AssertionError(f"canonicalized on the general path: {value!r}")

    monkeypatch.setattr(rfc8785, "dumps", general_path)
    assert jcs({"args": {"amount": 12.5, "qty": 10.0}, "tool": "refund"}) == (
        b'{"args":{"amount":12.5,"qty":10},"tool":"refund"}'
    )
    assert jcs([0.0, -0.0, 0.25, 1e15]) == b"[0,0,0.25,1000000000000000]"


@pytest.mark.parametrize(
    "value",
    [
        {"\x00ctl": '\x1f\b\t\n\f\r"\\\x7f\u2028'},
        {"b": 1, "a": [True, None, "é"], "c": {"z": -(2**53) + 1}},
        ["\ud800"],
        {"big": 2**53},
        {"float": 1.0, "small": 1e-7, "large": 1e21},
        {"nan": float("nan")},
        [float("inf")],
        [float("-inf"), 1.5],
        {1: "non-string key"},
        {"nested": [[[]], {}]},
    ],
)
def test_jcs_agrees_with_the_rfc8785_package_on_the_edges(value: Any) -> None:
    _assert_jcs_agrees(value)


@pytest.mark.parametrize("depth", [10, 497, 498, 700, 993, 994, 5000])
@pytest.mark.parametrize("leaf", [1.0, 1, "x"])
def test_jcs_agrees_with_the_rfc8785_package_however_deep(depth: int, leaf: Any) -> None:
    # The fast path's walk has no depth limit, its encoder has: whatever
    # the nesting, the answer is rfc8785's (its bytes, or its refusal).
    for wrap in (lambda inner: [inner], lambda inner: {"a": inner}):
        value: Any = leaf
        for _ in range(depth):
            value = wrap(value)
        _assert_jcs_agrees(value)


def test_a_shared_container_is_written_twice_and_a_cycle_is_refused() -> None:
    shared = {"amount": 10.0}
    assert jcs([shared, shared]) == rfc8785.dumps([shared, shared])
    cycle: list[Any] = [1.5]
    cycle.append(cycle)
    # A handler's result may be cyclic: refused, not walked forever (on a
    # thread, so that a regression fails here instead of hanging the suite).
    outcome: list[BaseException | bytes] = []

    def attempt() -> None:
        try:
            outcome.append(jcs({"result": cycle}))
        except ValueError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "jcs walked a cycle without end"
    assert isinstance(outcome[0], ValueError)


@pytest.mark.parametrize(
    ("value", "levels"),
    [
        (1, 0),
        ([], 1),
        ({"a": 1}, 1),
        ([[]], 2),
        ({"a": {"b": [{}]}}, 4),
        ([1, {"a": [2, ("t", [3])]}], 5),  # tuples are arrays to json
        ({"wide": list(range(1000)), "deep": [[[1]]]}, 4),
    ],
)
def test_nesting_is_the_deepest_chain_of_arrays_and_objects(value: Any, levels: int) -> None:
    assert not nested_deeper_than(value, levels)
    if levels:
        assert nested_deeper_than(value, levels - 1)


# The encoders made once (json's C encoder without JSONEncoder.encode's set-up
# per call) must write exactly what json.dumps writes, or refuse the same way.
_any_json = st.recursive(
    _scalars | st.floats() | st.integers(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_keys | st.integers() | st.booleans() | st.none(), inner, max_size=4)
        | st.tuples(inner, inner)
    ),
    max_leaves=20,
)


def _assert_like_json_dumps(encode: Any, value: Any, **options: Any) -> None:
    try:
        expected = json.dumps(value, separators=(",", ":"), **options)
    except (ValueError, TypeError) as refused:  # NaN without allow_nan, keys of mixed types
        with pytest.raises(type(refused), match=re.escape(str(refused)[:20])):
            encode(value)
    else:
        assert encode(value) == expected


@settings(max_examples=500, deadline=None)
@given(_any_json)
def test_the_compact_encoders_write_what_json_dumps_writes(value: Any) -> None:
    _assert_like_json_dumps(compact_json, value)
    _assert_like_json_dumps(channel_compact_json, value)
    for sort_keys in (False, True):
        for ensure_ascii in (False, True):
            for allow_nan in (False, True):
                options = {"sort_keys": sort_keys, "ensure_ascii": ensure_ascii}
                encode = c_json_encoder(allow_nan=allow_nan, **options)
                _assert_like_json_dumps(encode, value, allow_nan=allow_nan, **options)


def test_the_compact_encoders_refuse_what_json_dumps_refuses() -> None:
    for encode in (compact_json, channel_compact_json):
        with pytest.raises(TypeError, match="not JSON serializable"):
            encode({"a": object()})
        with pytest.raises(TypeError, match="keys must be"):
            encode({(1, 2): 1})
        cycle: list[Any] = []
        cycle.append(cycle)
        with pytest.raises(RecursionError):  # json.dumps: ValueError; no cycle check here
            encode(cycle)
