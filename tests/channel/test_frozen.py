"""fast_init gives a frozen dataclass a cheaper __init__ and nothing else."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from channel.frozen import fast_init
from channel.wire import CallReply
from supervisor.stores.base import EffectRecord


@dataclasses.dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: str
    c: Any = None
    d: tuple[int, ...] = ()


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class Fast:
    a: int
    b: str
    c: Any = None
    d: tuple[int, ...] = ()


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1, "x"), {}),
        ((1, "x", [2]), {}),
        ((1,), {"b": "y", "d": (3,)}),
        ((), {"a": 1, "b": "x", "c": {"k": 1}, "d": (1, 2)}),
    ],
)
def test_it_builds_what_the_dataclass_builds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    plain, fast = Plain(*args, **kwargs), Fast(*args, **kwargs)
    assert dataclasses.astuple(plain) == dataclasses.astuple(fast)
    assert repr(plain).removeprefix("Plain") == repr(fast).removeprefix("Fast")
    assert fast == Fast(*args, **kwargs)
    if not isinstance(plain.c, (list, dict)):
        assert hash(fast) == hash(Fast(*args, **kwargs))


def test_it_keeps_the_signature_and_refuses_what_the_dataclass_refuses() -> None:
    assert list(inspect.signature(Fast).parameters) == ["a", "b", "c", "d"]
    with pytest.raises(TypeError):
        Fast(1)  # b is required
    with pytest.raises(TypeError):
        Fast(1, "x", z=2)  # no such field
    with pytest.raises(TypeError):
        Fast(1, "x", a=2)  # a given twice


def test_instances_stay_frozen_and_slotted() -> None:
    reply = CallReply("ok", "c1", "executed", result=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        reply.status = "error"  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        reply.extra = 1  # type: ignore[attr-defined]
    assert not hasattr(reply, "__dict__")
    assert reply == CallReply("ok", "c1", "executed", result=5)
    assert EffectRecord.__init__.__qualname__ == "EffectRecord.__init__"


def test_a_class_it_cannot_speed_up_is_refused() -> None:
    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    for cls in (Mutable, Factory, NoSlots):
        with pytest.raises(TypeError):
            fast_init(cls)
