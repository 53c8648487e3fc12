"""Serving an aiohttp application on a TCP address: the console and
``--metrics-listen`` (the channel and the admin API are Unix sockets)."""

from __future__ import annotations

from aiohttp import web

__all__ = ["serve_tcp"]

#: How long closing lets a request in progress finish.
SHUTDOWN_GRACE_S = 1.0


async def serve_tcp(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; the runner (clean it up to stop) and
    the port bound (the one the kernel chose when ``port`` is 0).

    Raises:
        OSError: the address cannot be bound (in use, not this host's, …).
    """
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
