"""The MCP comparison's client: the MCP python SDK's ``Client`` over stdio.

It spawns ``mcp_server.py`` through the SDK's stdio transport and measures
``tools/call`` of the same no-op tools with the same harness as the HTTP
targets (:func:`loadgen.measure`): N calls in flight, warm-up, a fixed window,
latency per call, CPU of both processes. The SDK multiplexes every request
over the one stdin/stdout pipe pair (JSON-RPC ids); the server runs each
request as a task of its own, so calls in flight do overlap.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from loadgen import add_point_args, measure, server_cpu_reader, write_result
from mcp import Client
from mcp.client.stdio import StdioServerParameters

SERVER: Final = Path(__file__).with_name("mcp_server.py")
#: How long the server gets to write its pid file after the handshake.
PID_TIMEOUT_S: Final = 30.0


def _read_pid(path: Path) -> int:
    deadline = time.monotonic() + PID_TIMEOUT_S
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.strip():
            return int(text)
        time.sleep(0.01)
    raise TimeoutError(f"the MCP server wrote no pid to {path}")


async def _main(args: argparse.Namespace, pid_file: Path) -> dict[str, Any]:
    parameters = StdioServerParameters(
        command=sys.executable, args=[str(SERVER), "--pid-file", str(pid_file)]
    )
    ids = itertools.count(1)
    points = []
    async with Client(parameters, read_timeout_seconds=30.0) as client:
        server_cpu = server_cpu_reader(_read_pid(pid_file))
        for tool in args.tools.split(","):

            async def call(check: bool, tool: str = tool) -> str | None:
                n = next(ids)
                result = await client.call_tool(tool, {"n": n})
                if result.is_error:
                    return f"tool error: {result.content!r}"[:300]
                if check and result.structured_content != {"result": n}:
                    return f"wrong result {result.structured_content!r} for n={n}"
                return None

            for inflight in (int(n) for n in args.inflight.split(",")):
                point = await measure(
                    call,
                    inflight,
                    warmup_s=args.warmup,
                    duration_s=args.duration,
                    server_cpu=server_cpu,
                )
                points.append({"tool": tool, **point})
    return {"target": "mcp", "points": points}


def main(argv: list[str] | None = None) -> int:
    """Run the points given on the command line; their JSON to stdout (or ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_point_args(parser)
    args = parser.parse_args(argv)
    import uvloop

    with tempfile.TemporaryDirectory(prefix="hostcall-mcp-") as scratch:
        result = uvloop.run(_main(args, Path(scratch) / "server.pid"))
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
