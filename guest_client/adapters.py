"""Model adapters: a model's tool call in, the tool result that API expects out.

Models mint an id for every tool call (`call_…` from OpenAI, `toolu_…` from
Anthropic). The adapters send that id as the hostcall `call_id`, so when an
agent step is retried - the transport timed out, the guest restarted, the
framework replayed the turn - the host recognises the call and replays its
result instead of running it again.

Everything here is plain data in, plain data out: no I/O. `HostClient` and
`AsyncHostClient` drive it (`call_openai`, `call_anthropic`, `tools_for`).
SDK objects (pydantic models of the `openai` and `anthropic` packages) and
plain dicts are both accepted; the results are plain dicts that both SDKs
accept as message parameters. Neither SDK is imported.
"""

from __future__ import annotations

import json

from guest_client.errors import Refused, ToolError
from guest_client.wire import is_call_id, validate_call_id

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from guest_client.errors import HostcallError

__all__ = [
    "FLAVORS",
    "ToolUse",
    "anthropic_tool_use",
    "call_id_for",
    "openai_tool_use",
    "tool_definitions",
]

#: The tool-definition formats `tools_for` produces.
FLAVORS = ("openai", "openai-responses", "anthropic", "mcp")

# Refusals that no model action can fix: the guest as a whole cannot go on
# (its identity is refused, its execution was cancelled or fenced) or the host
# failed. They are raised to the agent program instead of shown to the model.
_GUEST_WIDE_CODES = frozenset(
    {
        "unauthenticated",
        "plan_mismatch",
        "execution_fenced",
        "origin_denied",
        "cancelled",
        "bad_request",
        "store_unavailable",
    }
)
_DERIVED_PREFIX = "hc-sha256-"


def call_id_for(model_id: str) -> str:
    """The hostcall `call_id` for a model's tool-call id.

    The model's id itself when it fits the protocol's alphabet
    (`[A-Za-z0-9._:-]{1,128}`), as OpenAI's and Anthropic's ids do; otherwise
    `hc-sha256-` and the SHA-256 of the id in hex - still one fixed
    `call_id` per model id, so retries stay safe.

    Raises:
        ValueError: `model_id` is empty.
        TypeError: `model_id` is not a string.
    """
    if not isinstance(model_id, str):
        raise TypeError(f"a tool-call id must be a str, not {type(model_id).__name__}")
    if not model_id:
        raise ValueError("the tool call has an empty id")
    if is_call_id(model_id):
        return model_id
    import hashlib  # Only ids from unusual providers need it.

    return validate_call_id(_DERIVED_PREFIX + hashlib.sha256(model_id.encode()).hexdigest())


class ToolUse:
    """One tool call a model asked for, ready to send, and how to answer it.

    Attributes:
        api: `"chat_completions"`, `"responses"` or `"anthropic"`: the shape
            of the answer.
        model_id: The id the model gave the call; the answer names it.
        call_id: The hostcall `call_id` (see `call_id_for`).
        tool: The tool's name.
        args: The arguments, a JSON object; None when `problem` is set.
        problem: A refusal made here, before anything was sent (the model's
            `arguments` were not a JSON object), or None.
    """

    __slots__ = ("api", "args", "call_id", "model_id", "problem", "tool")

    def __init__(
        self,
        api: str,
        model_id: str,
        tool: str,
        args: dict[str, Any] | None,
        problem: Refused | None = None,
    ) -> None:
        self.api = api
        self.model_id = model_id
        self.call_id = call_id_for(model_id)
        self.tool = tool
        self.args = args
        self.problem = problem

    def answer(self, result: Any) -> dict[str, Any]:
        """The message that gives the model the tool's `result`.

        A string result is passed as it is; anything else as compact JSON.
        """
        return self._message(_text_of(result), is_error=False)

    def answer_error(self, error: HostcallError) -> dict[str, Any]:
        """The message that tells the model the call was refused or failed.

        Only errors the model can act on become an answer: a `Refused` that
        concerns this call (`invalid_arguments`, `tool_not_allowed`,
        `budget_exhausted`, `approval_rejected`, ...) - nothing ran - and a
        `ToolError` - it ran, failed, and nothing is in doubt. The content is
        `{"error": {"code", "message", ...}}` as JSON; Anthropic's answer is
        also marked `is_error`.

        Raises:
            HostcallError: `error` itself, when the model must not see it as
                an answer: `EffectUnknown` and `ResultInvalid` (the effect
                may have happened or did happen: a model told "error" might
                call again under a new id and do it twice), `TransportError`,
                `ConfigurationError`, and refusals of the guest as a whole
                (identity, `cancelled`, `store_unavailable`, `bad_request`).
        """
        if isinstance(error, Refused) and error.code not in _GUEST_WIDE_CODES:
            detail: dict[str, Any] = {"code": error.code, "message": error.message}
            if error.details is not None:
                detail["details"] = error.details
            detail["tool_ran"] = False
        elif isinstance(error, ToolError):
            detail = {"code": error.code, "message": error.message}
            if error.type is not None:
                detail["type"] = error.type
            detail["tool_ran"] = True
        else:
            raise error
        return self._message(_dumps({"error": detail}), is_error=True)

    def _message(self, text: str, *, is_error: bool) -> dict[str, Any]:
        if self.api == "anthropic":
            message: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": self.model_id,
                "content": text,
            }
            if is_error:
                message["is_error"] = True
            return message
        if self.api == "responses":
            return {"type": "function_call_output", "call_id": self.model_id, "output": text}
        return {"role": "tool", "tool_call_id": self.model_id, "content": text}

    def __repr__(self) -> str:
        return f"ToolUse({self.api}, call_id={self.call_id!r}, tool={self.tool!r})"


def openai_tool_use(tool_call: Any) -> ToolUse:
    """Read an OpenAI function tool call.

    Accepts a Chat Completions tool call (`{"id", "type": "function",
    "function": {"name", "arguments"}}`) and a Responses API function call
    item (`{"type": "function_call", "call_id", "name", "arguments"}`), as SDK
    objects or dicts. `arguments` is the model's JSON text; one that is not a
    JSON object (malformed, duplicate keys, NaN, not an object) becomes
    `problem`, an `invalid_arguments` refusal made before anything is sent.
    Empty `arguments` mean `{}` (some OpenAI-compatible servers send `""` for
    a tool without parameters); an already parsed object is taken as is.

    Raises:
        ValueError: It is not a function tool call (no id or name, or a
            custom tool call, whose input is free text).
    """
    function = _field(tool_call, "function")
    kind = _field(tool_call, "type")
    if function is not None:
        if kind not in (None, "function"):
            raise ValueError(f"not a function tool call: type {kind!r}")
        api, model_id = "chat_completions", _field(tool_call, "id")
        name, arguments = _field(function, "name"), _field(function, "arguments")
    elif kind in (None, "function_call") and _field(tool_call, "call_id") is not None:
        api, model_id = "responses", _field(tool_call, "call_id")
        name, arguments = _field(tool_call, "name"), _field(tool_call, "arguments")
    else:
        raise ValueError(
            "not an OpenAI function tool call (expected a Chat Completions tool call "
            f"or a Responses function_call item), got type {kind!r}"
        )
    _require_ids(model_id, name)
    args, problem = _parse_arguments(arguments)
    use = ToolUse(api, model_id, name, args)
    if problem is not None:
        use.problem = _refusal(use, problem)
        use.args = None
    return use


def anthropic_tool_use(block: Any) -> ToolUse:
    """Read an Anthropic `tool_use` content block (`{"type": "tool_use",
    "id", "name", "input"}`), an SDK object or a dict.

    An `input` that is not a JSON object becomes `problem`, an
    `invalid_arguments` refusal made before anything is sent.

    Raises:
        ValueError: It is not a `tool_use` block (no id or name, or another
            type such as `server_tool_use`).
    """
    kind = _field(block, "type")
    if kind not in (None, "tool_use"):
        raise ValueError(f"not a tool_use block: type {kind!r}")
    model_id, name = _field(block, "id"), _field(block, "name")
    _require_ids(model_id, name)
    raw = _field(block, "input")
    use = ToolUse("anthropic", model_id, name, None)
    if raw is None:
        use.args = {}
    elif _is_mapping(raw):
        use.args = dict(raw)
    else:
        use.problem = _refusal(use, f"input must be a JSON object, not {type(raw).__name__}")
    return use


def tool_definitions(tools: list[dict[str, Any]], flavor: str) -> list[dict[str, Any]]:
    """The plan's tools (`GET /v1/plan`'s `tools`) as one API's tool definitions.

    Args:
        tools: The tools as the host describes them.
        flavor: `"openai"` (Chat Completions `tools`), `"openai-responses"`
            (Responses API `tools`), `"anthropic"` (Messages API `tools`) or
            `"mcp"` (MCP `Tool` objects, as in a `tools/list` result).

    Raises:
        ValueError: An unknown flavor.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(map(repr, FLAVORS))}, not {flavor!r}")
    return [_definition(tool, flavor) for tool in tools]


def _definition(tool: Mapping[str, Any], flavor: str) -> dict[str, Any]:
    name = tool["name"]
    description = tool.get("description") or ""
    schema = tool.get("input_schema") or {"type": "object", "properties": {}}
    if flavor == "openai":
        function: dict[str, Any] = {"name": name}
        if description:
            function["description"] = description
        function["parameters"] = schema
        return {"type": "function", "function": function}
    if flavor == "openai-responses":
        definition: dict[str, Any] = {"type": "function", "name": name}
        if description:
            definition["description"] = description
        definition["parameters"] = schema
        # Not strict: strict mode needs every property required, which
        # optional parameters with defaults are not.
        definition["strict"] = False
        return definition
    if flavor == "anthropic":
        definition = {"name": name}
        if description:
            definition["description"] = description
        definition["input_schema"] = schema
        return definition
    # MCP: inputSchema/outputSchema in camelCase; an outputSchema must describe
    # an object (structured content), so other result schemas are left out.
    definition = {"name": name}
    if description:
        definition["description"] = description
    definition["inputSchema"] = schema
    output = tool.get("output_schema")
    if isinstance(output, dict) and output.get("type") == "object":
        definition["outputSchema"] = output
    reversibility = tool.get("reversibility")
    definition["annotations"] = {"destructiveHint": reversibility != "reversible"}
    definition["_meta"] = {
        "hostcall/reversibility": reversibility,
        "hostcall/approval": tool.get("approval"),
        "hostcall/cost": tool.get("cost"),
    }
    return definition


def _field(obj: Any, name: str) -> Any:
    """A field of an SDK object (an attribute) or of a dict (a key)."""
    if _is_mapping(obj):
        return obj.get(name)
    return getattr(obj, name, None)


def _is_mapping(obj: Any) -> bool:
    if isinstance(obj, dict):
        return True
    from collections.abc import Mapping

    return isinstance(obj, Mapping)


def _require_ids(model_id: Any, name: Any) -> None:
    if not isinstance(model_id, str) or not model_id:
        raise ValueError("the tool call has no id; the model's id is what makes a retry safe")
    if not isinstance(name, str) or not name:
        raise ValueError("the tool call has no tool name")


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_arguments(arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The arguments as an object, or why they are not one."""
    if _is_mapping(arguments):
        return dict(arguments), None
    if arguments is None:
        return {}, None
    if not isinstance(arguments, str):
        return None, f"arguments must be a JSON string, not {type(arguments).__name__}"
    if not arguments.strip():
        return {}, None
    # The same strictness as the channel (docs/protocol.md, "Endpoints"), so that the model learns
    # here, with a precise message, instead of from a 400.
    try:
        parsed = json.loads(
            arguments, object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant
        )
    except (ValueError, RecursionError) as exc:
        return None, f"arguments are not valid JSON: {exc}"
    if not isinstance(parsed, dict):
        return None, f"arguments must be a JSON object, not {type(parsed).__name__}"
    return parsed, None


def _refusal(use: ToolUse, problem: str) -> Refused:
    return Refused(
        f"{problem}; nothing was sent",
        code="invalid_arguments",
        details=[{"loc": [], "msg": problem}],
        call_id=use.call_id,
    )


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text_of(result: Any) -> str:
    return result if isinstance(result, str) else _dumps(result)
