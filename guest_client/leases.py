"""How long a call may wait for an operator's approval, learnt from the plan.

A call of a tool that needs approval is answered only once an operator
decides, or its lease (the plan's ``approval_timeout_s``) runs out. The
client's own deadline must not end first — else a guest gives up (and calls
it "may have run") while the proposal still waits. So such calls get at
least the lease and :data:`APPROVAL_SLACK_S` more (docs/guests.md, "Calls
that wait for approval"). The client knows the leases without asking: the
supervisor puts them in ``HOSTCALL_APPROVAL_LEASES`` (a JSON object, tool →
seconds; only when the plan has such tools), and every ``GET /v1/plan`` the
client reads (``plan()``, ``tools()``) updates them.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing and collections.abc cost import time (test_client_import)
    from collections.abc import Mapping
    from typing import Any, Final

__all__ = [
    "APPROVAL_SLACK_S",
    "LEASES_VARIABLE",
    "approval_leases",
    "call_timeout",
    "leases_from_environ",
]

#: The variable the supervisor sets (an addition of hostcall's own, docs/guests.md).
LEASES_VARIABLE: Final = "HOSTCALL_APPROVAL_LEASES"

#: Beyond the lease: time for the decision (or the expiry) to reach the guest.
APPROVAL_SLACK_S: Final = 30.0


def approval_leases(plan: Mapping[str, Any]) -> dict[str, float]:
    """Tool name → seconds a call of it may wait for approval (only the tools
    whose ``approval`` is ``always``)."""
    lease = plan.get("approval_timeout_s")
    tools = plan.get("tools")
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not isinstance(tools, list):
        return {}
    return {
        str(t["name"]): float(lease)
        for t in tools
        if isinstance(t, dict) and t.get("approval") == "always" and "name" in t
    }


def leases_from_environ(environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """The leases ``HOSTCALL_APPROVAL_LEASES`` names (``{}`` if none, or unreadable)."""
    text = (os.environ if environ is None else environ).get(LEASES_VARIABLE)
    if not text:
        return {}
    import json  # only when there is one: the client imports light (test_client_import)

    try:
        value = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {
        str(name): float(lease)
        for name, lease in value.items()
        if isinstance(lease, int | float) and not isinstance(lease, bool) and lease > 0
    }


def call_timeout(
    leases: Mapping[str, float], tool: str, deadline: float, timeout: float | None
) -> float | None:
    """The timeout of one call: the caller's own, else enough for ``tool``'s
    approval lease when it has one (at least the policy's ``deadline``), else
    ``None`` (the policy's deadline)."""
    if timeout is not None:
        return timeout
    lease = leases.get(tool)
    if lease is None:
        return None
    return max(deadline, lease + APPROVAL_SLACK_S)
