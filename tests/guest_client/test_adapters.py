"""Model adapters: a model's tool call in, under the model's own id, and the
tool result that API expects out - through both clients, on a real socket.

Every tool call is given as a plain dict and, when the `openai` / `anthropic`
packages are installed (the `sdk` extra), also as the SDK's own object; the
answers and tool definitions are then also validated against the SDK's own
parameter types. Without the packages the dict cases still run: nothing is
skipped.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from typing import Any

import pytest
from client_fakehost import PLAN_HASH, Reply, ScriptedHost, ambiguous, ok, refused

from guest_client import EffectUnknown, Refused, ResultInvalid
from guest_client.adapters import (
    anthropic_tool_use,
    call_id_for,
    openai_tool_use,
    tool_definitions,
)

HAS_OPENAI = importlib.util.find_spec("openai") is not None
HAS_ANTHROPIC = importlib.util.find_spec("anthropic") is not None
OPENAI_FORMS = ["dict", *(["sdk"] if HAS_OPENAI else [])]
ANTHROPIC_FORMS = ["dict", *(["sdk"] if HAS_ANTHROPIC else [])]

CHARGE_ARGS = {"account": "acct_1", "cents": 500}


def chat_tool_call(form: str, model_id: str, name: str, arguments: str) -> Any:
    data = {"id": model_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if form == "dict":
        return data
    import openai.types.chat as chat

    sdk_type = getattr(chat, "ChatCompletionMessageFunctionToolCall", None)
    return (sdk_type or chat.ChatCompletionMessageToolCall).model_validate(data)


def responses_tool_call(form: str, model_id: str, name: str, arguments: str) -> Any:
    data = {
        "type": "function_call",
        "id": "fc_item_1",  # the output item's id; the call's id is call_id
        "call_id": model_id,
        "name": name,
        "arguments": arguments,
    }
    if form == "dict":
        return data
    from openai.types.responses import ResponseFunctionToolCall

    return ResponseFunctionToolCall.model_validate(data)


def tool_use_block(form: str, model_id: str, name: str, tool_input: Any) -> Any:
    data = {"type": "tool_use", "id": model_id, "name": name, "input": tool_input}
    if form == "dict":
        return data
    from anthropic.types import ToolUseBlock

    if not isinstance(tool_input, dict):
        # The SDK builds response objects without validating them, as here.
        return ToolUseBlock.model_construct(**data)
    return ToolUseBlock.model_validate(data)


def accepted_by_sdk(sdk_type: Any, value: dict[str, Any]) -> bool:
    """Whether the SDK's own parameter type takes `value` whole (nothing dropped)."""
    from pydantic import TypeAdapter

    return bool(TypeAdapter(sdk_type).validate_python(value) == value)


def check_chat_answer(form: str, answer: dict[str, Any]) -> None:
    assert set(answer) == {"role", "tool_call_id", "content"}
    if form == "sdk":
        from openai.types.chat import ChatCompletionToolMessageParam

        assert accepted_by_sdk(ChatCompletionToolMessageParam, answer)


def check_responses_answer(form: str, answer: dict[str, Any]) -> None:
    assert set(answer) == {"type", "call_id", "output"}
    if form == "sdk":
        from openai.types.responses.response_input_param import FunctionCallOutput

        assert accepted_by_sdk(FunctionCallOutput, answer)


def check_anthropic_answer(form: str, answer: dict[str, Any]) -> None:
    assert set(answer) <= {"type", "tool_use_id", "content", "is_error"}
    if form == "sdk":
        from anthropic.types import ToolResultBlockParam

        assert accepted_by_sdk(ToolResultBlockParam, answer)


@pytest.mark.parametrize("form", OPENAI_FORMS)
def test_a_chat_completions_tool_call_runs_under_the_models_id_and_answers_a_tool_message(
    host: ScriptedHost, client: Any, form: str
) -> None:
    host.answer(ok("call_abc123", {"charge_id": "ch_1"}))
    tool_call = chat_tool_call(form, "call_abc123", "charge", json.dumps(CHARGE_ARGS))

    answer = client.call_openai(tool_call)

    assert answer == {
        "role": "tool",
        "tool_call_id": "call_abc123",
        "content": '{"charge_id":"ch_1"}',
    }
    check_chat_answer(form, answer)
    (request,) = host.requests
    assert request.json() == {"call_id": "call_abc123", "tool": "charge", "args": CHARGE_ARGS}


@pytest.mark.parametrize("form", OPENAI_FORMS)
def test_a_responses_api_function_call_runs_under_its_call_id_not_its_item_id(
    host: ScriptedHost, client: Any, form: str
) -> None:
    host.answer(ok("call_r1", "charged"))
    item = responses_tool_call(form, "call_r1", "charge", json.dumps(CHARGE_ARGS))

    answer = client.call_openai(item)

    assert answer == {"type": "function_call_output", "call_id": "call_r1", "output": "charged"}
    check_responses_answer(form, answer)
    assert host.requests[0].json()["call_id"] == "call_r1"


@pytest.mark.parametrize("form", ANTHROPIC_FORMS)
def test_an_anthropic_tool_use_block_runs_under_its_id_and_answers_a_tool_result(
    host: ScriptedHost, client: Any, form: str
) -> None:
    host.answer(ok("toolu_01A", [1, 2]))

    answer = client.call_anthropic(tool_use_block(form, "toolu_01A", "charge", CHARGE_ARGS))

    assert answer == {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "[1,2]"}
    check_anthropic_answer(form, answer)
    assert host.requests[0].json() == {
        "call_id": "toolu_01A",
        "tool": "charge",
        "args": CHARGE_ARGS,
    }


@pytest.mark.parametrize("form", OPENAI_FORMS)
def test_a_retried_agent_step_sends_the_same_call_id_and_gets_the_replayed_result(
    host: ScriptedHost, client: Any, form: str
) -> None:
    host.answer(ok("call_x", "ch_1"), ok("call_x", "ch_1", effect="replayed"))
    tool_call = chat_tool_call(form, "call_x", "charge", json.dumps(CHARGE_ARGS))

    first = client.call_openai(tool_call)
    again = client.call_openai(tool_call)

    assert first == again
    assert host.requests[0].body == host.requests[1].body


@pytest.mark.parametrize("form", OPENAI_FORMS)
@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ('{"account": "acct_1", ', "not valid JSON"),
        ('["acct_1", 500]', "must be a JSON object"),
        ('{"cents": 1, "cents": 2}', "duplicate key"),
        ('{"cents": NaN}', "NaN is not JSON"),
    ],
)
def test_malformed_arguments_are_refused_to_the_model_before_anything_is_sent(
    host: ScriptedHost, client: Any, form: str, arguments: str, why: str
) -> None:
    answer = client.call_openai(chat_tool_call(form, "call_bad", "charge", arguments))

    assert host.requests == []
    assert answer["tool_call_id"] == "call_bad"
    error = json.loads(answer["content"])["error"]
    assert error["code"] == "invalid_arguments"
    assert error["tool_ran"] is False
    assert why in error["message"]
    check_chat_answer(form, answer)


@pytest.mark.parametrize("form", ANTHROPIC_FORMS)
def test_anthropic_input_that_is_not_an_object_is_refused_before_anything_is_sent(
    host: ScriptedHost, client: Any, form: str
) -> None:
    block = tool_use_block(form, "toolu_bad", "charge", ["acct_1"])

    answer = client.call_anthropic(block)

    assert host.requests == []
    assert answer["is_error"] is True
    assert json.loads(answer["content"])["error"]["code"] == "invalid_arguments"
    check_anthropic_answer(form, answer)


def test_empty_arguments_mean_no_arguments(host: ScriptedHost, client: Any) -> None:
    host.answer(ok("call_e", 0))

    client.call_openai(chat_tool_call("dict", "call_e", "ping", ""))

    assert host.requests[0].json()["args"] == {}


@pytest.mark.parametrize("form", ANTHROPIC_FORMS)
def test_a_refusal_the_model_can_act_on_comes_back_as_an_error_result_with_details(
    host: ScriptedHost, client: Any, form: str
) -> None:
    details = [{"loc": ["cents"], "msg": "Input should be a valid integer"}]
    host.answer(refused(422, "invalid_arguments", "toolu_r", details=details))

    answer = client.call_anthropic(tool_use_block(form, "toolu_r", "charge", {"cents": "x"}))

    assert answer["is_error"] is True
    error = json.loads(answer["content"])["error"]
    assert (error["code"], error["details"], error["tool_ran"]) == (
        "invalid_arguments",
        details,
        False,
    )
    check_anthropic_answer(form, answer)


@pytest.mark.parametrize("form", OPENAI_FORMS)
def test_a_tool_error_comes_back_to_the_model_saying_the_tool_ran(
    host: ScriptedHost, client: Any, form: str
) -> None:
    host.answer(
        Reply(
            500,
            {
                "status": "error",
                "call_id": "call_t",
                "effect": "failed",
                "error": {"code": "tool_error", "type": "ValueError", "message": "no account"},
            },
        )
    )

    answer = client.call_openai(responses_tool_call(form, "call_t", "charge", "{}"))

    error = json.loads(answer["output"])["error"]
    assert error == {
        "code": "tool_error",
        "message": "no account",
        "type": "ValueError",
        "tool_ran": True,
    }


@pytest.mark.parametrize(
    ("reply", "raised", "code"),
    [
        (ambiguous("call_u", "unknown", key="e" * 64), EffectUnknown, "ambiguous"),
        (
            Reply(
                500,
                {
                    "status": "error",
                    "call_id": "call_u",
                    "effect": "executed",
                    "error": {"code": "result_invalid", "message": "not an int"},
                    "idempotency_key": "e" * 64,
                },
            ),
            ResultInvalid,
            "result_invalid",
        ),
        (refused(403, "execution_fenced", "call_u"), Refused, "execution_fenced"),
        (refused(401, "unauthenticated"), Refused, "unauthenticated"),
    ],
)
def test_outcomes_the_model_must_not_read_as_an_answer_are_raised_with_the_call_id(
    host: ScriptedHost, client: Any, reply: Reply, raised: type[Exception], code: str
) -> None:
    host.answer(reply)

    with pytest.raises(raised) as caught:
        client.call_openai(chat_tool_call("dict", "call_u", "charge", "{}"))

    error: Any = caught.value
    assert (error.code, error.call_id) == (code, "call_u")
    if raised is not Refused:
        assert error.idempotency_key == "e" * 64


def test_a_model_id_outside_the_protocols_alphabet_maps_to_one_stable_call_id(
    host: ScriptedHost, client: Any
) -> None:
    model_id = "call 1/ü" + "x" * 200
    derived = call_id_for(model_id)
    host.answer(ok(derived, 1), ok(derived, 1, effect="replayed"))

    first = client.call_openai(chat_tool_call("dict", model_id, "charge", "{}"))
    client.call_openai(chat_tool_call("dict", model_id, "charge", "{}"))

    assert derived.startswith("hc-sha256-") and len(derived) <= 128
    assert [request.json()["call_id"] for request in host.requests] == [derived, derived]
    assert first["tool_call_id"] == model_id
    assert call_id_for("toolu_01A.b:c-d") == "toolu_01A.b:c-d"


@pytest.mark.parametrize(
    ("adapter", "tool_call", "why"),
    [
        (
            openai_tool_use,
            {"id": "c1", "type": "custom", "custom": {"name": "x", "input": "y"}},
            "not an OpenAI function tool call",
        ),
        (
            openai_tool_use,
            {"type": "function", "function": {"name": "x", "arguments": "{}"}},
            "no id",
        ),
        (
            openai_tool_use,
            {"id": "c1", "type": "function", "function": {"arguments": "{}"}},
            "no tool name",
        ),
        (openai_tool_use, {"type": "message", "content": []}, "not an OpenAI function"),
        (
            anthropic_tool_use,
            {"type": "server_tool_use", "id": "s1", "name": "web_search"},
            "not a tool_use block",
        ),
        (anthropic_tool_use, {"type": "tool_use", "name": "x", "input": {}}, "no id"),
    ],
)
def test_something_that_is_not_a_function_tool_call_is_a_value_error(
    adapter: Callable[[Any], Any], tool_call: dict[str, Any], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        adapter(tool_call)


PLAN_TOOLS = [
    {
        "name": "charge",
        "description": "Charge an account.",
        "input_schema": {
            "type": "object",
            "properties": {"account": {"type": "string"}, "cents": {"type": "integer"}},
            "required": ["account", "cents"],
            "additionalProperties": False,
        },
        "output_schema": {"type": "object", "additionalProperties": True},
        "reversibility": "irreversible",
        "approval": "always",
        "cost": 10,
    },
    {
        "name": "lookup",
        "description": "",
        "input_schema": {"type": "object", "properties": {"account": {"type": "string"}}},
        "output_schema": {"type": "string"},
        "reversibility": "reversible",
        "approval": "never",
        "cost": 0,
    },
]


@pytest.mark.parametrize("form", OPENAI_FORMS)
def test_tools_for_openai_gives_chat_completions_and_responses_function_tools(
    host: ScriptedHost, client: Any, form: str
) -> None:
    plan = {"plan_hash": PLAN_HASH, "name": "p", "tools": PLAN_TOOLS, "budget": {}}
    host.answer(Reply(200, plan), Reply(200, plan))

    chat = client.tools_for("openai")
    responses = client.tools_for("openai-responses")

    assert chat[0] == {
        "type": "function",
        "function": {
            "name": "charge",
            "description": "Charge an account.",
            "parameters": PLAN_TOOLS[0]["input_schema"],
        },
    }
    assert chat[1]["function"] == {"name": "lookup", "parameters": PLAN_TOOLS[1]["input_schema"]}
    assert responses[0] == {
        "type": "function",
        "name": "charge",
        "description": "Charge an account.",
        "parameters": PLAN_TOOLS[0]["input_schema"],
        "strict": False,
    }
    if form == "sdk":
        import openai.types.chat as sdk_chat
        from openai.types.responses import FunctionToolParam

        chat_param = getattr(sdk_chat, "ChatCompletionFunctionToolParam", None)
        for definition in chat:
            assert accepted_by_sdk(chat_param or sdk_chat.ChatCompletionToolParam, definition)
        for definition in responses:
            assert accepted_by_sdk(FunctionToolParam, definition)


@pytest.mark.parametrize("form", ANTHROPIC_FORMS)
def test_tools_for_anthropic_gives_messages_api_tools(
    host: ScriptedHost, client: Any, form: str
) -> None:
    host.answer(Reply(200, {"plan_hash": PLAN_HASH, "tools": PLAN_TOOLS}))

    tools = client.tools_for("anthropic")

    assert tools == [
        {
            "name": "charge",
            "description": "Charge an account.",
            "input_schema": PLAN_TOOLS[0]["input_schema"],
        },
        {"name": "lookup", "input_schema": PLAN_TOOLS[1]["input_schema"]},
    ]
    if form == "sdk":
        from anthropic.types import ToolParam

        assert all(accepted_by_sdk(ToolParam, tool) for tool in tools)


def test_tools_for_mcp_gives_mcp_tools_with_hints_and_hostcall_metadata() -> None:
    charge, lookup = tool_definitions(PLAN_TOOLS, "mcp")

    assert charge == {
        "name": "charge",
        "description": "Charge an account.",
        "inputSchema": PLAN_TOOLS[0]["input_schema"],
        "outputSchema": PLAN_TOOLS[0]["output_schema"],
        "annotations": {"destructiveHint": True},
        "_meta": {
            "hostcall/reversibility": "irreversible",
            "hostcall/approval": "always",
            "hostcall/cost": 10,
        },
    }
    # MCP's outputSchema describes structured content, an object: a string
    # result has none.
    assert "outputSchema" not in lookup
    assert lookup["annotations"] == {"destructiveHint": False}


def test_an_unknown_tool_format_fails_before_any_request(host: ScriptedHost, client: Any) -> None:
    with pytest.raises(ValueError, match="flavor"):
        client.tools_for("gemini")
    assert host.requests == []
