"""The sync client: `connect()` and `HostClient`.

`HostClient` drives the flows of `guest_client.flows` with blocking sends and
`time.sleep`; every decision about retrying, polling and what a response
means is made there.
"""

from __future__ import annotations

import _thread
import time

from guest_client.env import GuestEnvironment
from guest_client.errors import HostcallError
from guest_client.flows import call_flow, plan_flow, status_flow
from guest_client.leases import approval_leases, call_timeout, leases_from_environ
from guest_client.retry import Budget, RetryPolicy
from guest_client.wire import Sleep, TransportFailure, mint_call_id

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from types import TracebackType
    from typing import Any, TypeVar

    from guest_client.adapters import ToolUse
    from guest_client.flows import Flow
    from guest_client.wire import Reply, Transport

    T = TypeVar("T")

__all__ = ["HostClient", "connect"]


def connect(*, retry: RetryPolicy | None = None) -> HostClient:
    """A client for this guest, from the environment the supervisor set.

    Reads `HOSTCALL_SOCKET`, `HOSTCALL_INVOCATION`, `HOSTCALL_EXECUTION`,
    `HOSTCALL_PLAN` and the credential (from the fd `HOSTCALL_CREDENTIAL_FD`
    names, once per process; else `HOSTCALL_CREDENTIAL`). Opens no
    connection yet.

    Args:
        retry: Bounds on retries and time per operation; safe defaults.

    Raises:
        ConfigurationError: This process is not a hostcall guest, or its
            environment is unusable.
    """
    return HostClient(GuestEnvironment.from_environ(), retry=retry)


class HostClient:
    """Calls host tools through the channel. Thread-safe; use one per process.

    Every operation retries transport failures with backoff within its
    `RetryPolicy`; `timeout=` on an operation replaces the policy's deadline
    for it. Close it (or use it as a context manager) to close its
    connections.
    """

    def __init__(
        self,
        environment: GuestEnvironment,
        *,
        retry: RetryPolicy | None = None,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
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
        self._lock = _thread.allocate_lock()
        self._closed = False

    @property
    def environment(self) -> GuestEnvironment:
        """Who this guest is."""
        return self._environment

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of every operation."""
        return self._retry

    def call(
        self,
        tool: str,
        args: Mapping[str, Any] | None = None,
        *,
        call_id: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Call a host tool and return its result.

        Args:
            tool: The tool's name in the plan.
            args: Its arguments (a JSON object); None means `{}`.
            call_id: Names this call for the host: the host runs one
                `call_id` at most once and replays its result. Pass the
                model's tool-call id to make retries of a whole agent step
                safe; by default a fresh id is minted and reused for every
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
        flow = call_flow(self._budget(timeout), call_id, tool, args)
        return self._run(flow)

    def status(
        self, call_id: str, wait: float | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """The state of a call, as `GET /v1/calls/{call_id}` reports it.

        Runs nothing. Returns the body for every state of the call: `ok`
        (with `result`), `ambiguous` (`in_flight` or `unknown`),
        `awaiting_approval`, `error`, and `refused` with `error.code`
        `not_found` when the host holds no record of it.

        Args:
            call_id: The call.
            wait: Long-poll up to this many seconds (0-60) for a call in
                flight to settle.
            timeout: Seconds for the request and its retries.

        Raises:
            Refused: The request was refused (identity, bad request).
            TransportError: The host could not be reached in time.
            ValueError: `call_id` or `wait` is malformed.
        """
        return self._run(status_flow(self._budget(timeout), call_id, wait))

    def plan(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The plan as this guest sees it (`GET /v1/plan`): `plan_hash`,
        `name`, `tools` and what is left of the `budget`.

        Raises:
            Refused: The request was refused.
            TransportError: The host could not be reached in time.
        """
        plan = self._run(plan_flow(self._budget(timeout)))
        self._leases = approval_leases(plan)
        return plan

    def tools(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """The tools this guest may call, with their JSON Schemas,
        reversibility, approval rule and cost.

        Raises:
            Refused: The request was refused.
            TransportError: The host could not be reached in time.
        """
        tools: list[dict[str, Any]] = self.plan(timeout=timeout)["tools"]
        return tools

    def tools_for(self, flavor: str, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """The plan's tools as tool definitions for a model API.

        Args:
            flavor: `"openai"` (Chat Completions), `"openai-responses"`
                (Responses API), `"anthropic"` (Messages API) or `"mcp"`
                (MCP `Tool` objects).
            timeout: Seconds for the request and its retries.

        Raises:
            Refused: The request was refused.
            TransportError: The host could not be reached in time.
            ValueError: An unknown flavor (raised before any request).
        """
        from guest_client.adapters import tool_definitions

        tool_definitions([], flavor)  # An unknown flavor fails before the round trip.
        return tool_definitions(self.tools(timeout=timeout), flavor)

    def call_openai(self, tool_call: Any, *, timeout: float | None = None) -> dict[str, Any]:
        """Run an OpenAI function tool call; return the message that answers it.

        The model's id is the `call_id` (see `guest_client.adapters`), so a
        retried agent step replays the call instead of running it again.
        Takes Chat Completions tool calls and Responses API `function_call`
        items, SDK objects or dicts. Returns `{"role": "tool",
        "tool_call_id", "content"}` for Chat Completions and
        `{"type": "function_call_output", "call_id", "output"}` for the
        Responses API. `arguments` that are not a JSON object are refused
        before anything is sent; refusals the model can act on and tool
        errors come back as an answer with `{"error": {...}}` content.

        Args:
            tool_call: The model's tool call.
            timeout: Seconds for the whole call; default `retry.deadline`.

        Raises:
            EffectUnknown: The tool may have run.
            ResultInvalid: The tool ran but its result is invalid.
            TransportError: The host could not be reached in time.
            Refused: The guest as a whole was refused (identity, cancelled).
            ValueError: `tool_call` is not a function tool call.
        """
        from guest_client.adapters import openai_tool_use

        return self._call_tool_use(openai_tool_use(tool_call), timeout)

    def call_anthropic(self, block: Any, *, timeout: float | None = None) -> dict[str, Any]:
        """Run an Anthropic `tool_use` block; return its `tool_result` block.

        The block's id is the `call_id`, as with `call_openai`. Returns
        `{"type": "tool_result", "tool_use_id", "content"}`, with
        `"is_error": True` for a refusal the model can act on or a tool
        error.

        Args:
            block: The `tool_use` content block, an SDK object or a dict.
            timeout: Seconds for the whole call; default `retry.deadline`.

        Raises:
            EffectUnknown: The tool may have run.
            ResultInvalid: The tool ran but its result is invalid.
            TransportError: The host could not be reached in time.
            Refused: The guest as a whole was refused (identity, cancelled).
            ValueError: `block` is not a `tool_use` block.
        """
        from guest_client.adapters import anthropic_tool_use

        return self._call_tool_use(anthropic_tool_use(block), timeout)

    def _call_tool_use(self, use: ToolUse, timeout: float | None) -> dict[str, Any]:
        if use.problem is not None:
            return use.answer_error(use.problem)
        try:
            result = self.call(use.tool, use.args, call_id=use.call_id, timeout=timeout)
        except HostcallError as error:
            return use.answer_error(error)
        return use.answer(result)

    def close(self) -> None:
        """Close the client's connections. Later operations raise RuntimeError."""
        with self._lock:
            transport, self._transport = self._transport, None
            self._closed = True
        if transport is not None:
            transport.close()

    def __enter__(self) -> HostClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostClient({self._environment!r}, retry={self._retry!r})"

    def _budget(self, timeout: float | None) -> Budget:
        return Budget(self._retry, self._clock, timeout=timeout)

    def _get_transport(self) -> Transport:
        with self._lock:
            if self._closed:
                raise RuntimeError("the hostcall client is closed")
            if self._transport is None:
                # Imported on first use: socket is most of the client's import time.
                from guest_client.transport import UnixTransport

                self._transport = UnixTransport(
                    self._environment.socket_path,
                    self._environment.identity_headers(),
                )
            return self._transport

    def _run(self, flow: Flow[T]) -> T:
        transport = self._get_transport()
        reply: Reply = None
        try:
            while True:
                action = flow.send(reply)
                if isinstance(action, Sleep):
                    self._sleep(action.seconds)
                    reply = None
                    continue
                try:
                    reply = transport.send(action)
                except TransportFailure as failure:
                    reply = failure
        except StopIteration as stop:
            value: T = stop.value
            return value
        finally:
            flow.close()
