"""The benchmark's tools: irreversible no-ops, one async and one sync.

``plan.toml`` beside this file names them. Both return their argument, so a
call does nothing but cross the whole pipeline: identity, origin, plan,
canonicalize, replay check, budget, BeginDispatch (the durable pending row),
handler, commit and receipt.
"""

from __future__ import annotations

from supervisor import tool


@tool(reversibility="irreversible")
async def noop(n: int) -> int:
    """Return ``n``; runs on the event loop."""
    return n


@tool(reversibility="irreversible")
def noop_sync(n: int) -> int:
    """Return ``n``; a sync handler, so it runs in a worker thread."""
    return n
