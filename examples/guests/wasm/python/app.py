"""A hostcall guest in Python, run as a WebAssembly component (docs/wasm.md).

CPython built for WASI runs it inside the supervisor; it calls host tools
through the ``host`` interface of ``channel/hostcall.wit`` — the same JSON as
the HTTP endpoint of each name, answered with its HTTP status — instead of a
socket. Build it with componentize-py (``pip install componentize-py``)::

    componentize-py -d channel/hostcall.wit -w agent componentize app \\
        -p examples/guests/wasm/python -o agent-py.wasm

and run it: ``hostcall run --plan PLAN --wasm agent-py.wasm -- steps plan``.

Modes (argv), as the C guest's (``agent.c``):
  steps STEP...   each STEP ``call:CALL_ID:TOOL:ARGS_JSON``, ``status:CALL_ID[:WAIT_MS]``
                  or ``plan``; prints ``<http status> <reply body>`` per step
  bench TOOL SECONDS [WARMUP]  calls TOOL ({"n": i}) one at a time, WARMUP seconds
                  unmeasured, then SECONDS; prints {"calls", "seconds", "p50_us", "p99_us"}
  env             prints its argv and environment, one per line
  spin            burns CPU until stopped
  sleep SECONDS   sleeps (WASI's poll), then prints ``slept <seconds measured>``
"""

from __future__ import annotations

import json
import os
import sys
import time

import wit_world
from wit_world.imports import host


def steps(items: list[str]) -> int:
    for item in items:
        kind, _, rest = item.partition(":")
        if kind == "call":
            call_id, tool, args = rest.split(":", 2)
            request = {"call_id": call_id, "tool": tool, "args": json.loads(args)}
            status, reply = host.call(json.dumps(request))
        elif kind == "status":
            call_id, _, wait_ms = rest.partition(":")
            status, reply = host.status(call_id, int(wait_ms or 0))
        elif kind == "plan":
            status, reply = host.plan()
        else:
            print(f"agent: unknown step {item}", file=sys.stderr)
            return 2
        print(status, reply, flush=True)
    return 0


def bench(tool: str, seconds: float, warmup: float) -> int:
    took: list[float] = []
    measured = time.monotonic() + warmup
    end = measured + seconds
    made = 0
    while (started := time.monotonic()) < end:
        request = {"call_id": f"b{made}", "tool": tool, "args": {"n": made}}
        made += 1
        status, reply = host.call(json.dumps(request))
        if status != 200:
            print(f"agent: {reply}", file=sys.stderr)
            return 1
        if started >= measured:
            took.append((time.monotonic() - started) * 1e6)
    took.sort()
    p50 = took[len(took) // 2] if took else 0.0
    p99 = took[len(took) * 99 // 100] if took else 0.0
    print(json.dumps({"calls": len(took), "seconds": seconds, "p50_us": p50, "p99_us": p99}))
    return 0


class WitWorld(wit_world.WitWorld):
    def run(self, args: list[str]) -> int:
        if args[:1] == ["steps"]:
            return steps(args[1:])
        if args == ["env"]:
            for arg in sys.argv:
                print("argv", arg)
            for name, value in os.environ.items():
                print(f"env {name}={value}")
            return 0
        if args[:1] == ["bench"] and len(args) in (3, 4):
            return bench(args[1], float(args[2]), float(args[3]) if len(args) == 4 else 0.0)
        if args == ["spin"]:
            while True:
                pass
        if args[:1] == ["sleep"] and len(args) == 2:
            started = time.monotonic()
            time.sleep(float(args[1]))
            print(f"slept {time.monotonic() - started:.3f}")
            return 0
        print("usage: agent-py.wasm steps STEP... | env | spin | sleep SECONDS", file=sys.stderr)
        return 2
