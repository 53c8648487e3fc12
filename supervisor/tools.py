"""Tools: a handler plus everything the broker needs to admit a call to it.

``@tool(...)`` tags a function; :class:`Tool` resolves it once per plan: the
input model from the signature (through pydantic), the output schema from the
return annotation, and the reversibility, where the strictest tag found on the
handler or anything it wraps (``__wrapped__``) wins and no tag means
irreversible (docs/operations.md, "Plans").
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import logging
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    PydanticUserError,
    TypeAdapter,
    ValidationError,
    create_model,
)

from channel.wire import MAX_TOOL_NAME, is_tool_name
from supervisor.errors import EffectOutcomeUnknown, PlanError, Refusal

__all__ = [
    "DEFAULT_AMBIGUOUS_ERRORS",
    "DEFAULT_TIMEOUT_S",
    "Reversibility",
    "Tool",
    "ToolOptions",
    "has_non_finite",
    "strictest_reversibility",
    "tool",
]

logger = logging.getLogger(__name__)

Reversibility = Literal["reversible", "costly", "irreversible"]
Approval = Literal["never", "always"]

DEFAULT_TIMEOUT_S: Final = 300.0
#: The most problems an ``invalid_arguments`` refusal lists (the last one
#: then says how many more there were).
MAX_DETAILS: Final = 100
DEFAULT_AMBIGUOUS_ERRORS: Final[tuple[type[BaseException], ...]] = (
    TimeoutError,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
    EffectOutcomeUnknown,
)
_STRICTNESS: Final[Mapping[str, int]] = {"reversible": 0, "costly": 1, "irreversible": 2}
_OPTIONS_ATTR: Final = "__hostcall_tool__"
_LAZY_ORIGINS: Final = (
    collections.abc.Iterator,
    collections.abc.Iterable,
    collections.abc.Generator,
    collections.abc.AsyncIterator,
    collections.abc.AsyncIterable,
    collections.abc.AsyncGenerator,
)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class ToolOptions:
    """What ``@tool(...)`` records on a handler; ``None`` means "not said here"."""

    name: str | None = None
    description: str | None = None
    reversibility: Reversibility | None = None
    approval: Approval | None = None
    cost: float | None = None
    timeout_s: float | None = None
    target_args: tuple[str, ...] | None = None
    max_calls: int | None = None
    input_model: type[BaseModel] | None = None


@overload
def tool(func: F, /) -> F: ...


@overload
def tool(
    func: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    reversibility: Reversibility | None = None,
    approval: Approval | None = None,
    cost: float | None = None,
    timeout_s: float | None = None,
    target_args: Iterable[str] | None = None,
    max_calls: int | None = None,
    input_model: type[BaseModel] | None = None,
) -> Callable[[F], F]: ...


def tool(
    func: F | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    reversibility: Reversibility | None = None,
    approval: Approval | None = None,
    cost: float | None = None,
    timeout_s: float | None = None,
    target_args: Iterable[str] | None = None,
    max_calls: int | None = None,
    input_model: type[BaseModel] | None = None,
) -> F | Callable[[F], F]:
    """Tag a handler as a tool. Usable bare (``@tool``) or with options.

    The function is returned unchanged apart from the tag, so it stays
    callable and testable on its own.
    """
    if reversibility is not None and reversibility not in _STRICTNESS:
        raise PlanError(f"unknown reversibility {reversibility!r}")
    options = ToolOptions(
        name=name,
        description=description,
        reversibility=reversibility,
        approval=approval,
        cost=cost,
        timeout_s=timeout_s,
        target_args=tuple(target_args) if target_args is not None else None,
        max_calls=max_calls,
        input_model=input_model,
    )

    def tag(f: F) -> F:
        # Set on the function's own __dict__: functools.wraps copies it onto
        # wrappers, and __wrapped__ lets us find tags of the inner functions.
        setattr(f, _OPTIONS_ATTR, options)
        return f

    return tag(func) if func is not None else tag


def strictest_reversibility(handler: Callable[..., Any], *extra: str | None) -> Reversibility:
    """The strictest tag on ``handler``, anything it wraps, and ``extra``.

    An untagged handler is irreversible: doubt is resolved towards "do not
    run it twice".
    """
    tags: list[str] = [tag for tag in extra if tag is not None]
    seen: set[int] = set()
    current: Any = handler
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        options = current.__dict__.get(_OPTIONS_ATTR) if hasattr(current, "__dict__") else None
        if isinstance(options, ToolOptions) and options.reversibility is not None:
            tags.append(options.reversibility)
        current = getattr(current, "__wrapped__", None)
    if not tags:
        return "irreversible"
    strictest = max(tags, key=lambda tag: _STRICTNESS[tag])
    return typing.cast(Reversibility, strictest)


def _options_of(handler: Callable[..., Any]) -> ToolOptions:
    options = getattr(handler, _OPTIONS_ATTR, None)
    return options if isinstance(options, ToolOptions) else ToolOptions()


def _is_lazy(annotation: Any) -> bool:
    # Only the abstract lazy types: dict and list are Iterable too, but eager.
    origin = typing.get_origin(annotation) or annotation
    return origin in _LAZY_ORIGINS


@dataclass(frozen=True, slots=True, eq=False)
class Tool:
    """A resolved tool: handler, schemas and admission settings. Build with :meth:`build`."""

    name: str
    handler: Callable[..., Any]
    handler_path: str
    description: str
    input_model: type[BaseModel]
    model_argument: str | None  # the parameter that takes the whole model, if any
    output_adapter: TypeAdapter[Any] | None
    reversibility: Reversibility
    approval: Approval
    cost: float
    timeout_s: float
    target_args: tuple[str, ...]
    max_calls: int | None
    ambiguous_errors: tuple[type[BaseException], ...] = DEFAULT_AMBIGUOUS_ERRORS
    #: The output adapter would write a NaN or an infinity as ``null`` (a
    #: model, dataclass or TypedDict keeps its own config): the broker looks
    #: for them in the result first.
    output_nulls_non_finite: bool = False
    input_schema: dict[str, Any] = field(default_factory=dict)
    output_schema: dict[str, Any] | None = None
    #: ``input_model``'s field names, read once: pydantic's ``model_fields``
    #: is a descriptor that showed in the per-call profile.
    field_names: tuple[str, ...] = ()
    #: Whether the handler is an ``async def`` (or async generator): it runs
    #: on the event loop; otherwise in the worker pool. Found once, at build.
    is_async: bool = False

    @classmethod
    def build(
        cls,
        handler: Callable[..., Any],
        *,
        handler_path: str | None = None,
        overrides: ToolOptions | None = None,
        ambiguous_errors: tuple[type[BaseException], ...] = DEFAULT_AMBIGUOUS_ERRORS,
    ) -> Tool:
        """Resolve ``handler``; ``overrides`` (a plan file's settings) beat its tag.

        Raises:
            PlanError: the handler's signature cannot be turned into a schema.
        """
        if not callable(handler):
            raise PlanError(f"tool handler {handler!r} is not callable")
        tagged = _options_of(handler)
        file = overrides or ToolOptions()

        def pick(attr: str, default: Any) -> Any:
            for source in (file, tagged):
                value = getattr(source, attr)
                if value is not None:
                    return value
            return default

        name = pick("name", getattr(handler, "__name__", None))
        if not isinstance(name, str) or not name:
            raise PlanError(f"tool handler {handler!r} needs a name")
        if not is_tool_name(name):  # a request could not name it
            raise PlanError(f"tool {name[:64]!r}: a name is 1-{MAX_TOOL_NAME} characters of text")
        path = handler_path or f"{handler.__module__}:{handler.__qualname__}"
        doc = inspect.getdoc(handler) or ""
        input_model, model_argument = _input_model(name, handler, pick("input_model", None))
        output_adapter, output_schema, nulls_non_finite = _output(name, handler)
        approval = pick("approval", "never")
        if approval not in ("never", "always"):
            raise PlanError(f"tool {name!r}: approval must be 'never' or 'always'")
        timeout_s = float(pick("timeout_s", DEFAULT_TIMEOUT_S))
        cost = pick("cost", 0)
        if timeout_s <= 0 or cost < 0:
            raise PlanError(f"tool {name!r}: timeout_s must be > 0 and cost >= 0")
        reversibility = strictest_reversibility(handler, file.reversibility)
        if file.reversibility is not None and file.reversibility != reversibility:
            logger.warning(
                "tool %r: the plan says %s, but its handler is tagged %s: %s holds "
                "(the strictest tag wins)",
                name,
                file.reversibility,
                reversibility,
                reversibility,
            )
        target_args = tuple(pick("target_args", ()))
        unknown_targets = set(target_args) - set(input_model.model_fields)
        if unknown_targets:
            raise PlanError(
                f"tool {name!r}: target_args {sorted(unknown_targets)} not in its input"
            )
        return cls(
            name=name,
            handler=handler,
            handler_path=path,
            description=pick("description", doc.split("\n\n")[0].strip()),
            input_model=input_model,
            model_argument=model_argument,
            output_adapter=output_adapter,
            output_nulls_non_finite=nulls_non_finite,
            reversibility=reversibility,
            approval=approval,
            cost=cost,
            timeout_s=timeout_s,
            target_args=target_args,
            max_calls=pick("max_calls", None),
            ambiguous_errors=ambiguous_errors,
            input_schema=input_model.model_json_schema(),
            field_names=tuple(input_model.model_fields),
            output_schema=output_schema,
            is_async=inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler),
        )

    @property
    def reversible(self) -> bool:
        """Whether running it again after an unknown outcome is allowed."""
        return self.reversibility == "reversible"

    def canonicalize(self, args: Mapping[str, Any]) -> tuple[BaseModel, dict[str, Any]]:
        """Validate ``args`` (lax, unknown fields refused, defaults filled).

        Returns the validated model and its JSON form, the canonical arguments.

        Raises:
            Refusal: ``invalid_arguments`` with one detail per problem.
        """
        try:
            model = self.input_model.model_validate(args)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False)
            details = [{"loc": list(err["loc"]), "msg": err["msg"]} for err in errors[:MAX_DETAILS]]
            if len(errors) > MAX_DETAILS:  # one body can hold 100,000s: the reply stays small
                details[-1] = {"loc": [], "msg": f"and {len(errors) - MAX_DETAILS + 1} more"}
            raise Refusal(
                "invalid_arguments", f"arguments do not match {self.name}'s input", details=details
            ) from None
        try:
            canonical = model.model_dump(mode="json")
        except (ValueError, RecursionError) as exc:  # e.g. nested past the serializer's depth
            raise Refusal(
                "invalid_arguments",
                f"arguments of {self.name} cannot be serialized",
                details=[{"loc": [], "msg": str(exc)}],
            ) from None
        return model, canonical

    def bind(self, model: BaseModel) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments to call the handler with."""
        if self.model_argument is not None:
            return (), {self.model_argument: model}
        names = self.field_names if type(model) is self.input_model else type(model).model_fields
        return (), {name: getattr(model, name) for name in names}

    def describe(self) -> dict[str, Any]:
        """This tool as ``GET /v1/plan`` shows it (docs/protocol.md, "Endpoints")."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
            "output_schema": self.output_schema,
            "reversibility": self.reversibility,
            "approval": self.approval,
            "cost": self.cost,
        }

    def resolved(self) -> dict[str, Any]:
        """This tool's part of the resolved plan that ``plan_hash`` covers."""
        return {
            "handler": self.handler_path,
            "input_schema": self.input_schema,
            "output_schema": self.output_schema,
            "reversibility": self.reversibility,
            "approval": self.approval,
            "cost": self.cost,
            "timeout_s": self.timeout_s,
            "target_args": list(self.target_args),
            "max_calls": self.max_calls,
        }


def _forbid_extra(model: type[BaseModel]) -> type[BaseModel]:
    if model.model_config.get("extra") == "forbid":
        return model
    strict: type[BaseModel] = create_model(
        model.__name__, __base__=model, __config__=None, __module__=model.__module__
    )
    strict.model_config["extra"] = "forbid"
    strict.model_rebuild(force=True)
    return strict


def _input_model(
    name: str, handler: Callable[..., Any], explicit: type[BaseModel] | None
) -> tuple[type[BaseModel], str | None]:
    try:
        signature = inspect.signature(handler, eval_str=True)
    except (NameError, TypeError, ValueError) as exc:
        raise PlanError(f"tool {name!r}: cannot read the handler's signature: {exc}") from exc
    params = list(signature.parameters.values())
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise PlanError(f"tool {name!r}: parameter {param.name!r} must be a plain keyword")
    if explicit is None and len(params) == 1:
        annotation = params[0].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            explicit = annotation
    if explicit is not None:
        if len(params) != 1:
            raise PlanError(f"tool {name!r}: a handler with an input model takes one parameter")
        return _forbid_extra(explicit), params[0].name
    fields: dict[str, Any] = {}
    for param in params:
        if param.annotation is param.empty:
            # Its schema would accept any JSON a guest sends: say what it takes.
            raise PlanError(
                f"tool {name!r}: parameter {param.name!r} has no type annotation "
                f"(annotate it, e.g. `{param.name}: str`; `typing.Any` takes any JSON)"
            )
        annotation = param.annotation
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    try:
        model = create_model(f"{name}_input", __config__=ConfigDict(extra="forbid"), **fields)
    except Exception as exc:  # pydantic raises several types for bad annotations
        raise PlanError(f"tool {name!r}: cannot build an input schema: {exc}") from exc
    return model, None


def _output(
    name: str, handler: Callable[..., Any]
) -> tuple[TypeAdapter[Any] | None, dict[str, Any] | None, bool]:
    """The output adapter, its JSON Schema, and whether it would write a NaN
    or an infinity as ``null`` (see :attr:`Tool.output_nulls_non_finite`)."""
    try:
        hints = typing.get_type_hints(handler)
    except Exception as exc:  # NameError and friends from user annotations
        raise PlanError(f"tool {name!r}: cannot read the return annotation: {exc}") from exc
    if "return" not in hints or hints["return"] is Any:
        return None, None, False
    annotation = hints["return"]
    if typing.get_origin(annotation) is collections.abc.Awaitable or (
        inspect.isclass(annotation) and issubclass(annotation, collections.abc.Awaitable)
    ):
        return None, None, False
    if _is_lazy(annotation):
        # A lazy result is consumed inside the dispatch: the guest sees a list.
        item_args = typing.get_args(annotation)
        annotation = list[item_args[0]] if item_args else list[Any]  # type: ignore[valid-type]
    try:
        adapter, configured = _output_adapter(annotation)
        schema = adapter.json_schema()
        # A model, dataclass or TypedDict, also one inside the type ($defs),
        # serializes by its own config, which our adapter's does not replace.
        return adapter, schema, not configured or "$defs" in schema
    except Exception as exc:  # pydantic raises several types for unsupported types
        raise PlanError(f"tool {name!r}: cannot build an output schema: {exc}") from exc


#: pydantic writes a NaN or an infinity where the type is Any (a ``dict``'s
#: values) as ``null`` by default; kept as it is, it fails the JSON check and
#: the call answers ``result_invalid`` (docs/protocol.md), as it does unchecked.
_OUTPUT_CONFIG: Final = ConfigDict(ser_json_inf_nan="constants")


def _output_adapter(annotation: Any) -> tuple[TypeAdapter[Any], bool]:
    """The output schema's adapter, and whether it has :data:`_OUTPUT_CONFIG`.
    A model, dataclass or TypedDict has a config of its own, which pydantic
    will not let this one replace."""
    try:
        return TypeAdapter(annotation, config=_OUTPUT_CONFIG), True
    except PydanticUserError:
        return TypeAdapter(annotation), False


def has_non_finite(value: Any) -> bool:
    """Whether a NaN or an infinity is anywhere in ``value``: in containers,
    pydantic models and dataclasses, each looked into once."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            inner: Iterable[Any] = item.values()
        elif isinstance(item, list | tuple | set | frozenset):
            inner = item
        elif isinstance(item, BaseModel):
            inner = [*item.__dict__.values(), *(item.__pydantic_extra__ or {}).values()]
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            inner = [getattr(item, f.name) for f in dataclasses.fields(item)]
        else:
            continue
        todo.extend(inner)
    return False
