"""Plans: the sealed set of tools and limits one invocation runs under (docs/operations.md)."""

from __future__ import annotations

import difflib
import importlib
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.budget import BudgetLimits
from supervisor.canonical import jcs, sha256_hex
from supervisor.errors import PlanError
from supervisor.sandbox.policy import SandboxPolicy
from supervisor.tools import Tool, ToolOptions

__all__ = ["BudgetLimits", "Plan"]


class _ToolSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    handler: str
    description: str | None = None
    reversibility: Literal["reversible", "costly", "irreversible"] | None = None
    approval: Literal["never", "always"] | None = None
    cost: float | None = Field(default=None, ge=0)
    timeout_s: float | None = Field(default=None, gt=0)
    target_args: list[str] | None = None
    max_calls: int | None = Field(default=None, ge=0)


class _PlanSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "plan"
    max_calls: int | None = Field(default=None, ge=0)
    max_cost: float | None = Field(default=None, ge=0)
    deadline_s: float | None = Field(default=None, gt=0)
    approval_timeout_s: float = Field(default=300.0, gt=0)
    require_approval_for_irreversible: bool = False


class _SandboxSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    network: Literal["none", "host"] = "none"
    workdir: str | None = None
    read_only: list[str] = []
    read_write: list[str] = []
    hide: list[str] = []


class _PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    plan: _PlanSection = _PlanSection()
    tools: dict[str, _ToolSection] = {}
    sandbox: _SandboxSection | None = None


#: The keys each table of a plan file may have, for "did you mean".
_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "": tuple(_PlanFile.model_fields),
    "plan": tuple(_PlanSection.model_fields),
    "tools": tuple(_ToolSection.model_fields),
    "sandbox": tuple(_SandboxSection.model_fields),
}


def _problem(error: Any) -> str:
    """One validation error of a plan file, with a suggestion for a misspelt key."""
    loc = [str(part) for part in error["loc"]]
    where = ".".join(loc)
    if error["type"] != "extra_forbidden":
        return f"{where}: {error['msg']}"
    table = "tools" if loc[0] == "tools" and len(loc) == 3 else loc[0] if len(loc) > 1 else ""
    known = _KEYS.get(table, ())
    close = difflib.get_close_matches(loc[-1], known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
    return f"{where}: unknown key{hint}"


def _import_handler(path: str, folder: Path) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise PlanError(f"handler {path!r} must be 'module:attribute'")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:  # boundary: importing runs the user's module, which may raise anything
        raise PlanError(f"cannot import handler {path!r}: {exc!r}") from exc
    if not callable(target):
        raise PlanError(f"handler {path!r} is not callable")
    return target  # type: ignore[no-any-return]


class Plan:
    """The tools an invocation may call, its budget and approval settings.

    Sealed on construction: its :attr:`plan_hash` covers everything that
    decides how a call is admitted.
    """

    def __init__(
        self,
        tools: Iterable[Callable[..., Any] | Tool],
        *,
        name: str = "plan",
        max_calls: int | None = None,
        max_cost: float | None = None,
        deadline_s: float | None = None,
        approval_timeout_s: float = 300.0,
        require_approval_for_irreversible: bool = False,
        sandbox: SandboxPolicy | None = None,
        path: Path | None = None,
    ) -> None:
        resolved: dict[str, Tool] = {}
        for item in tools:
            built = item if isinstance(item, Tool) else Tool.build(item)
            if built.name in resolved:
                raise PlanError(f"two tools are named {built.name!r}")
            resolved[built.name] = built
        self.name = name
        self.tools: Mapping[str, Tool] = resolved
        #: What the plan's guests may see and touch (the ``[sandbox]`` table).
        self.sandbox = sandbox or SandboxPolicy()
        #: The plan file, when the plan was loaded from one.
        self.path = path
        self.approval_timeout_s = float(approval_timeout_s)
        self.require_approval_for_irreversible = require_approval_for_irreversible
        self.budget = BudgetLimits(
            max_calls=max_calls,
            max_cost=max_cost,
            deadline_s=deadline_s,
            tool_max_calls={
                t.name: t.max_calls for t in resolved.values() if t.max_calls is not None
            },
        )
        self.plan_hash = "sha256:" + sha256_hex(jcs(self.resolved()))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file; its folder goes on ``sys.path`` to import handlers.

        Raises:
            PlanError: unreadable TOML, unknown keys, handlers that do not import.
        """
        path = Path(path).resolve()
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PlanError(f"no plan file {path}") from None
        except IsADirectoryError:
            raise PlanError(f"{path} is a folder, not a plan file") from None
        except OSError as exc:
            raise PlanError(f"cannot read plan {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise PlanError(f"plan {path} is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as exc:
            raise PlanError(f"plan {path} is not valid TOML: {exc}") from None
        try:
            spec = _PlanFile.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(_problem(err) for err in exc.errors(include_url=False))
            raise PlanError(f"invalid plan {path}: {problems}") from None
        tools = []
        for tool_name, section in spec.tools.items():
            handler = _import_handler(section.handler, path.parent)
            overrides = ToolOptions(
                name=tool_name,
                description=section.description,
                reversibility=section.reversibility,
                approval=section.approval,
                cost=section.cost,
                timeout_s=section.timeout_s,
                target_args=tuple(section.target_args) if section.target_args is not None else None,
                max_calls=section.max_calls,
            )
            tools.append(Tool.build(handler, handler_path=section.handler, overrides=overrides))
        return cls(
            tools,
            name=spec.plan.name,
            max_calls=spec.plan.max_calls,
            max_cost=spec.plan.max_cost,
            deadline_s=spec.plan.deadline_s,
            approval_timeout_s=spec.plan.approval_timeout_s,
            require_approval_for_irreversible=spec.plan.require_approval_for_irreversible,
            sandbox=(
                SandboxPolicy.from_table(**spec.sandbox.model_dump(), base=path.parent)
                if spec.sandbox is not None
                else None
            ),
            path=path,
        )

    def resolved(self) -> dict[str, Any]:
        """The resolved plan: what ``plan_hash`` is the hash of (docs/operations.md, "Plans").

        A ``[sandbox]`` table enters it only when it asks for more than the
        defaults, so plans without one keep the hash they always had.
        """
        resolved: dict[str, Any] = {
            "name": self.name,
            "max_calls": self.budget.max_calls,
            "max_cost": self.budget.max_cost,
            "deadline_s": self.budget.deadline_s,
            "approval_timeout_s": self.approval_timeout_s,
            "require_approval_for_irreversible": self.require_approval_for_irreversible,
            "tools": {name: t.resolved() for name, t in sorted(self.tools.items())},
        }
        if not self.sandbox.is_default:
            resolved["sandbox"] = self.sandbox.resolved()
        return resolved

    def needs_approval(self, tool: Tool) -> bool:
        """Whether a call of ``tool`` waits for a decision before dispatch."""
        if tool.approval == "always":
            return True
        return self.require_approval_for_irreversible and tool.reversibility == "irreversible"

    def __repr__(self) -> str:
        return f"Plan(name={self.name!r}, tools={sorted(self.tools)}, plan_hash={self.plan_hash!r})"
