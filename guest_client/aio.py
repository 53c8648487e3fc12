"""The asyncio client: `AsyncHostClient`, the same semantics as `HostClient`.

    from guest_client.aio import connect

    async with connect() as client:
        results = await asyncio.gather(
            *(client.call("lookup", {"account": a}) for a in accounts)
        )

It drives the same sans-IO flows as the sync client (`guest_client.flows`):
every decision about retrying, polling and what a response means is shared,
only sending and waiting differ. Many calls may be in flight on one client,
each on a connection of its own. Standard library only; importing this module
loads `asyncio`, which `import guest_client` does not.
"""

from __future__ import annotations

import asyncio
import time

from guest_client.env import GuestEnvironment
from guest_client.errors import HostcallError
from guest_client.flows import call_flow, plan_flow, status_flow
from guest_client.leases import approval_leases, call_timeout, leases_from_environ
from guest_client.retry import Budget, RetryPolicy
from guest_client.wire import Sleep, TransportFailure, mint_call_id

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping
    from types import TracebackType
    from typing import Any, Protocol, TypeVar

    from guest_client.adapters import ToolUse
    from guest_client.flows import Flow
    from guest_client.wire import Reply, Request, Response

    T = TypeVar("T")

    class AsyncTransport(Protocol):
        """What an async client needs from a transport."""

        async def send(self, request: Request) -> Response:
            """Send one request and read its whole response.

            Raises:
                TransportFailure: No complete response arrived.
            """

        async def aclose(self) -> None:
            """Close every connection; later sends may fail."""


__all__ = ["AsyncHostClient", "connect"]


def connect(*, retry: RetryPolicy | None = None) -> AsyncHostClient:
    """An async client for this guest, from the environment the supervisor set.

    The same as `guest_client.connect()`: it reads `HOSTCALL_*` and the
    credential (from its fd, once per process; this is a short blocking read
    of a pipe the supervisor has already written and closed). Opens no
    connection yet.

    Args:
        retry: Bounds on retries and time per operation; safe defaults.

    Raises:
        ConfigurationError: This process is not a hostcall guest, or its
            environment is unusable.
    """
    return AsyncHostClient(GuestEnvironment.from_environ(), retry=retry)


class AsyncHostClient:
    """Calls host tools through the channel, with `async`/`await`.

    Many calls may be in flight at once (`asyncio.gather`, task groups): each
    is an independent operation with its own retries and deadline. Use it
    from one event loop; it is not thread-safe. Close it with `aclose()` or
    `async with`.

    `timeout=` bounds an operation the way `HostClient`'s does, rather than
    an `asyncio.timeout` around it: the deadline is part of the operation's
    retry budget, so a call still in flight when it passes ends in
    `EffectUnknown` with its `call_id` and `idempotency_key`, not in a bare
    cancellation. Cancelling a call's task stops waiting for it, not the
    call: a request that reached the host runs to its end there, and calling
    again with the same `call_id` returns its result.
    """

    def __init__(
        self,
        environment: GuestEnvironment,
        *,
        retry: RetryPolicy | None = None,
        transport: AsyncTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """Args:
        environment: Who this guest is and where the channel is.
        retry: Bounds on retries and time per operation.
        transport: Sends the requests; by default HTTP over the channel's
            Unix socket (a seam for tests and other transports).
        clock: Monotonic clock for deadlines.
        sleep: How to wait between attempts.
        """
        self._environment = environment
        self._retry = retry if retry is not None else RetryPolicy()
        self._transport = transport
        self._clock = clock
        self._sleep = sleep
        #: Tool → its approval lease: from the environment, then from any plan read.
        self._leases = leases_from_environ()
        self._closed = False

    @property
    def environment(self) -> GuestEnvironment:
        """Who this guest is."""
        return self._environment

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of every operation."""
        return self._retry

    async def call(
        self,
        tool: str,
        args: Mapping[str, Any] | None = None,
        *,
        call_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """Call a host tool and return its result. See `HostClient.call`.

        Args:
            tool: The tool's name in the plan.
            args: Its arguments (a JSON object); None means `{}`.
            call_id: Names this call for the host, which runs one `call_id`
                at most once; by default a fresh id, reused for every
                transport retry of this call.
            timeout: Seconds for the whole call, retries and polling
                included; default `retry.deadline`, or for a tool that
                needs approval at least its lease (guest_client.leases).

        Raises:
            Refused: The host did not run the tool (`.code` says why).
            ToolError: The tool ran and failed; calling again is safe.
            ResultInvalid: The tool ran and its effect happened, but its
                result is invalid.
            EffectUnknown: The tool may have run.
            TransportError: The host could not be reached in time.
            ValueError: `call_id` is malformed, or `args` hold NaN.
            TypeError: `args` is not a JSON object.
        """
        if call_id is None:
            call_id = mint_call_id()
        timeout = call_timeout(self._leases, tool, self._retry.deadline, timeout)
        return await self._run(call_flow(self._budget(timeout), call_id, tool, args))

    async def status(
        self,
        call_id: str,
        wait: float | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        """The state of a call (`GET /v1/calls/{call_id}`); runs nothing.
        See `HostClient.status`.

        Raises:
            Refused: The request was refused (identity, bad request).
            TransportError: The host could not be reached in time.
            ValueError: `call_id` or `wait` is malformed.
        """
        return await self._run(status_flow(self._budget(timeout), call_id, wait))

    async def plan(self, *, timeout: float | None = None) -> dict[str, Any]:  # noqa: ASYNC109
        """The plan as this guest sees it (`GET /v1/plan`).

        Raises:
            Refused: The request was refused.
            TransportError: The host could not be reached in time.
        """
        plan = await self._run(plan_flow(self._budget(timeout)))
        self._leases = approval_leases(plan)
        return plan

    async def tools(self, *, timeout: float | None = None) -> list[dict[str, Any]]:  # noqa: ASYNC109
        """The tools this guest may call, with their JSON Schemas,
        reversibility, approval rule and cost.

        Raises:
            Refused: The request was refused.
            TransportError: The host could not be reached in time.
        """
        tools: list[dict[str, Any]] = (await self.plan(timeout=timeout))["tools"]
        return tools

    async def tools_for(
        self,
        flavor: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> list[dict[str, Any]]:
        """The plan's tools as tool definitions for a model API.
        See `HostClient.tools_for`.

        Raises:
            Refused: The request was refused.
            TransportError: The host could not be reached in time.
            ValueError: An unknown flavor (raised before any request).
        """
        from guest_client.adapters import tool_definitions

        tool_definitions([], flavor)  # An unknown flavor fails before the round trip.
        return tool_definitions(await self.tools(timeout=timeout), flavor)

    async def call_openai(
        self,
        tool_call: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        """Run an OpenAI function tool call under the model's id; return the
        message that answers it. See `HostClient.call_openai`.

        Raises:
            EffectUnknown: The tool may have run.
            ResultInvalid: The tool ran but its result is invalid.
            TransportError: The host could not be reached in time.
            Refused: The guest as a whole was refused (identity, cancelled).
            ValueError: `tool_call` is not a function tool call.
        """
        from guest_client.adapters import openai_tool_use

        return await self._call_tool_use(openai_tool_use(tool_call), timeout)

    async def call_anthropic(
        self,
        block: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        """Run an Anthropic `tool_use` block under its id; return its
        `tool_result` block. See `HostClient.call_anthropic`.

        Raises:
            EffectUnknown: The tool may have run.
            ResultInvalid: The tool ran but its result is invalid.
            TransportError: The host could not be reached in time.
            Refused: The guest as a whole was refused (identity, cancelled).
            ValueError: `block` is not a `tool_use` block.
        """
        from guest_client.adapters import anthropic_tool_use

        return await self._call_tool_use(anthropic_tool_use(block), timeout)

    async def aclose(self) -> None:
        """Close the client's connections. Later operations raise RuntimeError."""
        transport, self._transport = self._transport, None
        self._closed = True
        if transport is not None:
            await transport.aclose()

    async def __aenter__(self) -> AsyncHostClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncHostClient({self._environment!r}, retry={self._retry!r})"

    async def _call_tool_use(
        self,
        use: ToolUse,
        timeout: float | None,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        if use.problem is not None:
            return use.answer_error(use.problem)
        try:
            result = await self.call(use.tool, use.args, call_id=use.call_id, timeout=timeout)
        except HostcallError as error:
            return use.answer_error(error)
        return use.answer(result)

    def _budget(self, timeout: float | None) -> Budget:
        return Budget(self._retry, self._clock, timeout=timeout)

    def _get_transport(self) -> AsyncTransport:
        if self._closed:
            raise RuntimeError("the hostcall client is closed")
        if self._transport is None:
            from guest_client.aio_transport import AsyncUnixTransport

            self._transport = AsyncUnixTransport(
                self._environment.socket_path, self._environment.identity_headers()
            )
        return self._transport

    async def _run(self, flow: Flow[T]) -> T:
        reply: Reply = None
        try:
            transport = self._get_transport()
            while True:
                action = flow.send(reply)
                if isinstance(action, Sleep):
                    await self._sleep(action.seconds)
                    reply = None
                    continue
                try:
                    reply = await transport.send(action)
                except TransportFailure as failure:
                    reply = failure
        except StopIteration as stop:
            value: T = stop.value
            return value
        finally:
            flow.close()
