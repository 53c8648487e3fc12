"""SPEC §5.4 and §10: tools, their schemas and tags, plan files and plan hashes."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from pydantic import BaseModel

from supervisor import Plan, tool
from supervisor.canonical import idempotency_key
from supervisor.errors import PlanError, Refusal
from supervisor.tools import Tool, ToolOptions, has_non_finite, strictest_reversibility

# -- handlers (module level: their string annotations resolve in this module) ----


def transfer(account: str, cents: int, memo: str = "none") -> dict[str, int]:
    """Move money.

    The second paragraph is not part of the description.
    """
    return {"cents": cents}


class Transfer(BaseModel):
    account: str
    cents: int = 0


def transfer_model(request: Transfer) -> int:
    return request.cents


class Lookup(BaseModel):
    account: str


# -- @tool --------------------------------------------------------------------


def test_bare_tool_tags_the_function_and_returns_it_still_callable() -> None:
    def ping(host: str) -> str:
        return f"pong {host}"

    tagged = tool(ping)

    assert tagged is ping
    assert tagged("h") == "pong h"
    built = Tool.build(tagged)
    assert built.name == "ping"
    assert built.reversibility == "irreversible"  # a bare tag says nothing about it
    assert built.approval == "never"
    assert built.cost == 0
    assert built.timeout_s == 300.0
    assert built.target_args == ()
    assert built.max_calls is None


def test_tool_with_options_carries_every_setting_into_the_built_tool() -> None:
    @tool(
        name="send_mail",
        description="Send one mail.",
        reversibility="costly",
        approval="always",
        cost=2.5,
        timeout_s=7,
        target_args=["to"],
        max_calls=3,
    )
    def mail(to: str, body: str = "") -> None:
        return None

    built = Tool.build(mail)

    assert built.name == "send_mail"
    assert built.description == "Send one mail."
    assert built.reversibility == "costly"
    assert built.approval == "always"
    assert built.cost == 2.5
    assert built.timeout_s == 7.0
    assert built.target_args == ("to",)
    assert built.max_calls == 3
    assert mail(to="x") is None


def test_tool_refuses_an_unknown_reversibility_tag() -> None:
    with pytest.raises(PlanError, match="reversibility"):
        tool(reversibility="sometimes")  # type: ignore[call-overload]


def test_the_description_defaults_to_the_first_paragraph_of_the_docstring() -> None:
    assert Tool.build(transfer).description == "Move money."


def test_a_plan_file_setting_overrides_the_decorators_and_keeps_the_rest() -> None:
    @tool(cost=5, approval="always", timeout_s=10)
    def pay(account: str) -> None:
        return None

    built = Tool.build(pay, overrides=ToolOptions(cost=7, name="pay2"))

    assert (built.name, built.cost, built.approval, built.timeout_s) == ("pay2", 7, "always", 10.0)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(ToolOptions(timeout_s=0), id="zero-timeout"),
        pytest.param(ToolOptions(cost=-1), id="negative-cost"),
        pytest.param(ToolOptions(approval="sometimes"), id="unknown-approval"),  # type: ignore[arg-type]
        pytest.param(ToolOptions(target_args=("nope",)), id="target-not-in-input"),
    ],
)
def test_tool_build_refuses_settings_that_make_no_sense(options: ToolOptions) -> None:
    with pytest.raises(PlanError):
        Tool.build(transfer, overrides=options)


def test_a_handler_with_star_args_cannot_become_a_tool() -> None:
    def anything(*args: int, **kwargs: int) -> None:
        return None

    with pytest.raises(PlanError, match="plain keyword"):
        Tool.build(anything)


# -- input schema from the signature --------------------------------------------


def test_the_input_schema_comes_from_the_signature_with_defaults_and_no_extras() -> None:
    schema = Tool.build(transfer).input_schema

    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["account", "cents"]
    assert schema["properties"]["account"]["type"] == "string"
    assert schema["properties"]["cents"]["type"] == "integer"
    assert schema["properties"]["memo"]["default"] == "none"


def test_canonicalize_fills_defaults_and_coerces_laxly() -> None:
    built = Tool.build(transfer)

    model, canonical = built.canonicalize({"account": "acct_1", "cents": "500"})

    assert canonical == {"account": "acct_1", "cents": 500, "memo": "none"}
    assert built.bind(model) == ((), {"account": "acct_1", "cents": 500, "memo": "none"})


def test_canonicalize_refuses_unknown_fields_and_bad_values_with_one_detail_each() -> None:
    built = Tool.build(transfer)

    with pytest.raises(Refusal) as caught:
        built.canonicalize({"account": "a", "cents": "lots", "surprise": 1})

    assert caught.value.code == "invalid_arguments"
    details = caught.value.details or []
    assert sorted(tuple(d["loc"]) for d in details) == [("cents",), ("surprise",)]
    assert all(isinstance(d["msg"], str) and d["msg"] for d in details)


def test_canonicalize_reports_a_missing_required_field() -> None:
    with pytest.raises(Refusal) as caught:
        Tool.build(transfer).canonicalize({"cents": 1})

    assert [d["loc"] for d in caught.value.details or []] == [["account"]]


def test_a_single_pydantic_model_parameter_is_the_whole_input() -> None:
    built = Tool.build(transfer_model)

    model, canonical = built.canonicalize({"account": "a", "cents": "3"})

    assert built.model_argument == "request"
    assert set(built.input_schema["properties"]) == {"account", "cents"}
    assert built.input_schema["additionalProperties"] is False
    assert canonical == {"account": "a", "cents": 3}
    args, kwargs = built.bind(model)
    assert args == ()
    assert isinstance(kwargs["request"], Transfer)
    assert transfer_model(**kwargs) == 3


def test_an_explicit_model_refuses_unknown_fields_without_changing_the_users_model() -> None:
    built = Tool.build(transfer_model)

    with pytest.raises(Refusal):
        built.canonicalize({"account": "a", "extra": True})
    # The user's own model keeps its own (lax) configuration.
    assert Transfer.model_validate({"account": "a", "extra": True}).account == "a"


def test_an_input_model_given_to_tool_replaces_the_signature() -> None:
    @tool(input_model=Lookup)
    def lookup(query: Any) -> str:
        return str(query.account)

    built = Tool.build(lookup)

    assert built.model_argument == "query"
    assert set(built.input_schema["properties"]) == {"account"}


def test_an_input_model_needs_a_handler_with_exactly_one_parameter() -> None:
    @tool(input_model=Lookup)
    def lookup(query: Any, other: int) -> str:
        return ""

    with pytest.raises(PlanError, match="one parameter"):
        Tool.build(lookup)


# -- output schema from the return annotation ------------------------------------


def _returns_iterator() -> Iterator[int]:
    yield 1


def _returns_generator() -> Generator[str, None, None]:
    yield "a"


def _returns_iterable() -> Iterable[float]:
    return [1.0]


async def _returns_async_iterator() -> AsyncIterator[int]:
    yield 1


def _returns_list() -> list[int]:
    return [1]


def _returns_dict() -> dict[str, int]:
    return {}


async def _returns_int_async() -> int:
    return 1


def _returns_any() -> Any:
    return None


def _returns_nothing_said():  # type: ignore[no-untyped-def]
    return None


def _array_of(item_type: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": item_type}}


@pytest.mark.parametrize(
    ("handler", "schema"),
    [
        pytest.param(_returns_iterator, _array_of("integer"), id="Iterator"),
        pytest.param(_returns_generator, _array_of("string"), id="Generator"),
        pytest.param(_returns_iterable, _array_of("number"), id="Iterable"),
        pytest.param(_returns_async_iterator, _array_of("integer"), id="AsyncIterator"),
        pytest.param(_returns_list, _array_of("integer"), id="list"),
        pytest.param(
            _returns_dict,
            {"type": "object", "additionalProperties": {"type": "integer"}},
            id="dict",
        ),
        pytest.param(_returns_int_async, {"type": "integer"}, id="async-int"),
        pytest.param(_returns_any, None, id="Any"),
        pytest.param(_returns_nothing_said, None, id="no-annotation"),
    ],
)
def test_the_output_schema_comes_from_the_return_annotation_and_lazy_results_are_lists(
    handler: Callable[..., Any], schema: dict[str, Any] | None
) -> None:
    built = Tool.build(handler)

    assert built.output_schema == schema
    assert (built.output_adapter is None) == (schema is None)


# -- reversibility through __wrapped__ ---------------------------------------------


def _wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    return wrapper


def _untagged(account: str) -> str:
    return account


def test_an_untagged_handler_is_irreversible() -> None:
    assert strictest_reversibility(_untagged) == "irreversible"
    assert Tool.build(_untagged).reversible is False


def test_a_wrapper_of_a_tagged_handler_keeps_its_tag() -> None:
    inner = tool(reversibility="reversible")(_wrap(_untagged))

    assert Tool.build(_wrap(inner)).reversibility == "reversible"
    assert Tool.build(_wrap(_wrap(inner))).reversible is True


@pytest.mark.parametrize(
    ("inner_tag", "outer_tag", "expected"),
    [
        ("irreversible", "reversible", "irreversible"),
        ("reversible", "irreversible", "irreversible"),
        ("costly", "reversible", "costly"),
        ("reversible", "costly", "costly"),
        ("reversible", "reversible", "reversible"),
    ],
)
def test_the_strictest_tag_in_a_wraps_chain_wins(
    inner_tag: Any, outer_tag: Any, expected: str
) -> None:
    inner = tool(reversibility=inner_tag)(_wrap(_untagged))
    middle = _wrap(inner)  # untagged itself, but wraps a tagged function
    outer = tool(reversibility=outer_tag)(_wrap(middle))

    assert strictest_reversibility(outer) == expected
    assert Tool.build(outer).reversibility == expected


@pytest.mark.parametrize(
    ("handler_tag", "file_tag", "expected"),
    [
        (None, "reversible", "reversible"),
        (None, None, "irreversible"),
        ("irreversible", "reversible", "irreversible"),  # the file cannot loosen a tag
        ("reversible", "irreversible", "irreversible"),
        ("reversible", "costly", "costly"),
        ("costly", None, "costly"),
    ],
)
def test_the_plan_files_tag_takes_part_in_strictest_wins(
    handler_tag: Any, file_tag: Any, expected: str
) -> None:
    handler = _wrap(_untagged)
    if handler_tag is not None:
        handler = tool(reversibility=handler_tag)(handler)

    built = Tool.build(handler, overrides=ToolOptions(reversibility=file_tag))

    assert built.reversibility == expected


def test_a_wrapped_cycle_does_not_hang_the_reversibility_walk() -> None:
    def a() -> None:
        return None

    def b() -> None:
        return None

    a.__wrapped__ = b  # type: ignore[attr-defined]
    b.__wrapped__ = a  # type: ignore[attr-defined]
    tool(reversibility="costly")(b)

    assert strictest_reversibility(a) == "costly"


# -- Plan: names, approvals, budgets ---------------------------------------------------


def test_two_tools_with_one_name_are_refused() -> None:
    @tool(name="transfer")
    def other(x: int) -> int:
        return x

    with pytest.raises(PlanError, match="transfer"):
        Plan([transfer, other])


def test_per_tool_max_calls_become_part_of_the_budget() -> None:
    @tool(max_calls=2)
    def limited(x: int) -> int:
        return x

    plan = Plan([limited, transfer], max_calls=9, max_cost=50, deadline_s=60)

    assert plan.budget.max_calls == 9
    assert plan.budget.max_cost == 50
    assert plan.budget.deadline_s == 60
    assert dict(plan.budget.tool_max_calls or {}) == {"limited": 2}


@pytest.mark.parametrize(
    ("approval", "reversibility", "require_for_irreversible", "expected"),
    [
        ("always", "reversible", False, True),
        ("always", "irreversible", False, True),
        ("never", "irreversible", False, False),
        ("never", "irreversible", True, True),
        ("never", "costly", True, False),
        ("never", "reversible", True, False),
        ("always", "reversible", True, True),
    ],
)
def test_needs_approval_follows_the_rule_and_the_irreversible_setting(
    approval: Any, reversibility: Any, require_for_irreversible: bool, expected: bool
) -> None:
    handler = tool(approval=approval, reversibility=reversibility)(_wrap(_untagged))
    plan = Plan([handler], require_approval_for_irreversible=require_for_irreversible)

    assert plan.needs_approval(plan.tools["_untagged"]) is expected


# -- idempotency keys ----------------------------------------------------------------


def _independent_key(tool_name: str, args: dict[str, Any]) -> str:
    return hashlib.sha256(rfc8785.dumps({"tool": tool_name, "args": args})).hexdigest()


def test_the_idempotency_key_is_sha256_of_the_jcs_of_tool_and_canonical_args() -> None:
    built = Tool.build(transfer)
    _, canonical = built.canonicalize({"account": "a", "cents": 5})

    key = idempotency_key(built.name, canonical)

    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert key == _independent_key("transfer", {"account": "a", "cents": 5, "memo": "none"})


def test_the_same_business_input_gives_the_same_key_however_it_is_spelled() -> None:
    built = Tool.build(transfer)
    spellings: list[dict[str, Any]] = [
        {"account": "a", "cents": 5},
        {"cents": 5, "account": "a"},
        {"cents": "5", "account": "a", "memo": "none"},
        {"memo": "none", "account": "a", "cents": 5.0},
    ]

    keys = {idempotency_key(built.name, built.canonicalize(args)[1]) for args in spellings}

    assert keys == {_independent_key("transfer", {"account": "a", "cents": 5, "memo": "none"})}


def test_other_arguments_or_another_tool_give_another_key() -> None:
    args = {"account": "a", "cents": 5, "memo": "none"}

    assert idempotency_key("transfer", args) != idempotency_key("transfer", {**args, "cents": 6})
    assert idempotency_key("transfer", args) != idempotency_key("refund", args)


# -- plan files ------------------------------------------------------------------------


@pytest.fixture
def plan_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PlanDir]:
    monkeypatch.setattr(sys, "path", list(sys.path))  # Plan.load adds the plan's folder
    folder = PlanDir(tmp_path)
    yield folder
    for name in folder.modules:
        sys.modules.pop(name, None)


HANDLERS = '''
from __future__ import annotations

from supervisor import tool


@tool(reversibility="irreversible")
def charge(account: str, cents: int) -> dict[str, str]:
    """Charge an account."""
    return {"charge_id": "ch_1"}


@tool(reversibility="reversible")
def read_balance(account: str) -> int:
    return 0


not_callable = 42
'''


class PlanDir:
    """A folder holding plan files and handler modules with names unique to one test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.modules: list[str] = []

    def module(self, source: str = HANDLERS) -> str:
        name = f"hc_handlers_{uuid.uuid4().hex}"
        (self.folder / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        self.modules.append(name)
        return name

    def plan(self, toml: str, name: str = "plan.toml") -> Path:
        path = self.folder / name
        path.write_text(textwrap.dedent(toml), encoding="utf-8")
        return path


def billing_toml(module: str, *, charge: str = "", plan: str = "") -> str:
    return f"""
        [plan]
        name = "billing"
        max_calls = 100
        max_cost = 1000
        deadline_s = 600
        approval_timeout_s = 300
        require_approval_for_irreversible = false
        {plan}

        [tools.charge]
        handler = "{module}:charge"
        reversibility = "irreversible"
        approval = "always"
        cost = 10
        timeout_s = 30
        target_args = ["account"]
        {charge}

        [tools.read_balance]
        handler = "{module}:read_balance"
        reversibility = "reversible"
    """


def test_plan_load_reads_the_spec_example_with_handlers_next_to_the_file(
    plan_dir: PlanDir,
) -> None:
    module = plan_dir.module()

    plan = Plan.load(plan_dir.plan(billing_toml(module)))

    assert plan.name == "billing"
    assert sorted(plan.tools) == ["charge", "read_balance"]
    charge = plan.tools["charge"]
    assert charge.handler_path == f"{module}:charge"
    assert (charge.reversibility, charge.approval, charge.cost) == ("irreversible", "always", 10)
    assert (charge.timeout_s, charge.target_args) == (30.0, ("account",))
    assert charge.description == "Charge an account."
    assert plan.tools["read_balance"].reversible is True
    assert (plan.budget.max_calls, plan.budget.max_cost, plan.budget.deadline_s) == (100, 1000, 600)
    assert plan.approval_timeout_s == 300.0
    assert plan.require_approval_for_irreversible is False
    assert plan.needs_approval(charge) is True


def test_plan_load_works_with_a_relative_path_from_another_directory(
    plan_dir: PlanDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = plan_dir.plan(billing_toml(plan_dir.module()))
    monkeypatch.chdir(path.parent.parent)

    plan = Plan.load(Path(path.parent.name) / path.name)

    assert sorted(plan.tools) == ["charge", "read_balance"]


def test_plan_hash_is_sha256_hex_and_stable_across_loads(plan_dir: PlanDir) -> None:
    path = plan_dir.plan(billing_toml(plan_dir.module()))

    first, second = Plan.load(path), Plan.load(path)

    assert re.fullmatch(r"sha256:[0-9a-f]{64}", first.plan_hash)
    assert first.plan_hash == second.plan_hash


def test_plan_hash_is_the_sha256_of_the_jcs_of_the_resolved_plan(plan_dir: PlanDir) -> None:
    plan = Plan.load(plan_dir.plan(billing_toml(plan_dir.module())))

    expected = hashlib.sha256(rfc8785.dumps(plan.resolved())).hexdigest()

    assert plan.plan_hash == f"sha256:{expected}"
    resolved_charge = plan.resolved()["tools"]["charge"]
    assert resolved_charge["input_schema"] == plan.tools["charge"].input_schema
    assert resolved_charge["handler"] == plan.tools["charge"].handler_path


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # Leading spaces keep "cost" apart from "max_cost", "timeout_s" from "approval_timeout_s".
        (" cost = 10\n", " cost = 11\n"),
        (" timeout_s = 30\n", " timeout_s = 31\n"),
        (" timeout_s = 30\n", " timeout_s = 30\nmax_calls = 3\n"),
        ('approval = "always"', 'approval = "never"'),
        ('target_args = ["account"]', "target_args = []"),
        ('reversibility = "reversible"', 'reversibility = "costly"'),
        ("max_calls = 100", "max_calls = 101"),
        ("max_cost = 1000", "max_cost = 999"),
        ("deadline_s = 600", "deadline_s = 601"),
        ("approval_timeout_s = 300", "approval_timeout_s = 30"),
        ("require_approval_for_irreversible = false", "require_approval_for_irreversible = true"),
        ('name = "billing"', 'name = "billing2"'),
        (':read_balance"', ':charge"'),
    ],
)
def test_plan_hash_changes_when_a_setting_changes(plan_dir: PlanDir, old: str, new: str) -> None:
    module = plan_dir.module()
    text = billing_toml(module)
    assert old in text

    base = Plan.load(plan_dir.plan(text, "a.toml"))
    changed = Plan.load(plan_dir.plan(text.replace(old, new, 1), "b.toml"))

    assert changed.plan_hash != base.plan_hash


@pytest.mark.parametrize(
    ("charge", "plan"),
    [
        pytest.param("colour = 'red'", "", id="unknown-tool-key"),
        pytest.param("", "max_calls_per_tool = 3", id="unknown-plan-key"),
        pytest.param("", "[extras]\nx = 1", id="unknown-top-level-table"),
        pytest.param("cost = -1", "", id="negative-cost"),
        pytest.param("", "deadline_s = 0", id="zero-deadline"),
    ],
)
def test_plan_load_refuses_unknown_keys_and_bad_values(
    plan_dir: PlanDir, charge: str, plan: str
) -> None:
    text = billing_toml(plan_dir.module(), charge=charge, plan=plan)

    with pytest.raises(PlanError):
        Plan.load(plan_dir.plan(text))


@pytest.mark.parametrize(
    "handler",
    [
        pytest.param("no_colon_here", id="no-attribute"),
        pytest.param("{module}:", id="empty-attribute"),
        pytest.param(":charge", id="empty-module"),
        pytest.param("hc_no_such_module_anywhere:charge", id="missing-module"),
        pytest.param("{module}:no_such_function", id="missing-attribute"),
        pytest.param("{module}:not_callable", id="not-callable"),
    ],
)
def test_plan_load_refuses_a_bad_handler_path(plan_dir: PlanDir, handler: str) -> None:
    module = plan_dir.module()
    text = f"""
        [tools.charge]
        handler = "{handler.format(module=module)}"
    """

    with pytest.raises(PlanError):
        Plan.load(plan_dir.plan(text))


def test_plan_load_refuses_a_handler_module_that_fails_to_import(plan_dir: PlanDir) -> None:
    module = plan_dir.module("def charge(:\n")  # a syntax error in the user's module

    with pytest.raises(PlanError, match=module):
        Plan.load(plan_dir.plan(f'[tools.charge]\nhandler = "{module}:charge"\n'))


def test_plan_load_refuses_target_args_that_are_not_in_the_input(plan_dir: PlanDir) -> None:
    text = billing_toml(plan_dir.module()).replace('["account"]', '["acount"]')

    with pytest.raises(PlanError, match="acount"):
        Plan.load(plan_dir.plan(text))


def test_plan_load_refuses_a_tool_defined_twice(plan_dir: PlanDir) -> None:
    module = plan_dir.module()
    section = f'[tools.charge]\nhandler = "{module}:charge"\n'

    with pytest.raises(PlanError):
        Plan.load(plan_dir.plan(section + section))


def test_plan_load_refuses_a_file_that_is_not_toml_or_not_there(plan_dir: PlanDir) -> None:
    with pytest.raises(PlanError):
        Plan.load(plan_dir.plan("this is = = not toml"))
    with pytest.raises(PlanError):
        Plan.load(plan_dir.folder / "missing.toml")


def test_plan_load_with_no_tools_gives_an_empty_plan_with_defaults(plan_dir: PlanDir) -> None:
    plan = Plan.load(plan_dir.plan("[plan]\n"))

    assert plan.name == "plan"
    assert dict(plan.tools) == {}
    assert plan.budget.max_calls is None
    assert plan.approval_timeout_s == 300.0


@pytest.mark.parametrize("name", ["x" * 257, "bad\ud800name"])
def test_a_tool_name_no_request_could_send_is_refused_when_the_plan_is_built(name: str) -> None:
    # A request's tool is 1-256 characters of text (docs/protocol.md): a
    # plan tool outside that could never be called.
    def handler() -> int:
        return 1

    with pytest.raises(PlanError, match="1-256 characters of text"):
        Plan([tool(reversibility="reversible", name=name)(handler)])


def test_a_tool_name_of_256_characters_is_a_name() -> None:
    def handler() -> int:
        return 1

    plan = Plan([tool(reversibility="reversible", name="t" * 256)(handler)])
    assert list(plan.tools) == ["t" * 256]


def test_non_finite_floats_are_found_anywhere_and_a_cycle_ends_the_search() -> None:
    @dataclasses.dataclass
    class Point:
        x: float

    class Box(BaseModel):
        items: list[Any]

    cyclic: list[Any] = [1.0]
    cyclic.extend([cyclic, cyclic])  # branching: walked once per container
    assert not has_non_finite(cyclic)
    assert not has_non_finite({"a": [1, 2.5, "nan", None], "b": Box(items=[Point(0.0)])})
    for hidden in (
        float("nan"),
        {"k": (1, {float("inf")})},
        Box(items=[{"x": [Point(float("-inf"))]}]),
        [cyclic, float("nan")],
    ):
        assert has_non_finite(hidden), hidden
