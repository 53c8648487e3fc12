"""The ceiling: a bare aiohttp server on a Unix socket, on uvloop.

``POST /v1/calls`` answers 200 with the request body. It is the stack hostcall's
channel is built on (aiohttp's ``web.UnixSite``, no access log), doing nothing
else, so the load generator's numbers against it are the most any server on
this stack can do on this machine.

    python echo_server.py --socket /tmp/echo.sock --ready-fd 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from aiohttp import web


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read(), content_type="application/json")


async def serve(socket_path: str, ready_fd: int | None) -> None:
    """Serve until SIGTERM or SIGINT; write one byte to ``ready_fd`` once listening."""
    app = web.Application()
    app.router.add_post("/v1/calls", _echo)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.UnixSite(runner, socket_path, backlog=1024)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if ready_fd is not None:
        os.write(ready_fd, b"r")
        os.close(ready_fd)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and serve."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--ready-fd", type=int, help="write one byte here once listening")
    args = parser.parse_args(argv)
    import uvloop

    uvloop.run(serve(args.socket, args.ready_fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
