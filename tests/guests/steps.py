"""The native twin of ``examples/guests/wasm/agent.c``'s ``steps`` mode.

Takes the same argv — ``steps STEP...`` with ``call:CALL_ID:TOOL:ARGS_JSON``,
``status:CALL_ID[:WAIT_MS]`` and ``plan`` — makes each request over the Unix
socket (raw HTTP, standard library only) and prints ``<http status> <reply
body>`` per step, as the WebAssembly guest does through its imports. The
transport test runs one scenario through both and compares what they saw.
"""

from __future__ import annotations

import json
import os
import sys

# The driven guest's connection and identity headers (it reads the
# credential when imported; this file runs beside it).
from driver import IDENTITY, UnixConnection


def main(steps: list[str]) -> int:
    headers = IDENTITY
    for step in steps:
        kind, _, rest = step.partition(":")
        body = None
        if kind == "call":
            call_id, tool, args = rest.split(":", 2)
            method, path = "POST", "/v1/calls"
            body = json.dumps({"call_id": call_id, "tool": tool, "args": json.loads(args)})
        elif kind == "status":
            call_id, _, wait_ms = rest.partition(":")
            wait = f"?wait={int(wait_ms) / 1000:g}" if wait_ms else ""
            method, path = "GET", f"/v1/calls/{call_id}{wait}"
        elif kind == "plan":
            method, path = "GET", "/v1/plan"
        else:
            print(f"steps: unknown step {step}", file=sys.stderr)
            return 2
        connection = UnixConnection(os.environ["HOSTCALL_SOCKET"])
        try:
            sent = {**headers, "Content-Type": "application/json"} if body else headers
            connection.request(method, path, body, sent)
            response = connection.getresponse()
            print(response.status, response.read().decode(), flush=True)
        finally:
            connection.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["steps"]:
        sys.exit("usage: steps.py steps STEP...")
    sys.exit(main(sys.argv[2:]))
