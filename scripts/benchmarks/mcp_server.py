"""The MCP comparison's server: the MCP python SDK over stdio, same no-op tools.

Started by ``mcp_client.py`` (the SDK's stdio client spawns it). It writes its
pid to the file named by ``--pid-file`` so the client can measure its CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mcp.server import MCPServer

server = MCPServer("hostcall-bench")


@server.tool()
async def noop(n: int) -> int:
    """Return ``n``; runs on the event loop."""
    return n


@server.tool()
def noop_sync(n: int) -> int:
    """Return ``n``; a sync tool."""
    return n


def main(argv: list[str] | None = None) -> int:
    """Write the pid file, then serve MCP on stdin/stdout until stdin closes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid-file", type=Path, required=True)
    args = parser.parse_args(argv)
    args.pid_file.write_text(str(os.getpid()))
    import anyio

    anyio.run(server.run_stdio_async, backend_options={"use_uvloop": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
