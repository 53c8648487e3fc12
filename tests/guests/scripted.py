"""A guest for CLI and crash tests; what it does is given in argv.

scripted.py exit N                 exit with N
scripted.py selfkill SIG           kill itself with signal SIG
scripted.py tree [PIDFILE]         start a child in its group and a setsid'd
                                   grandchild, print (and write, if PIDFILE
                                   is given) all pids and its pid namespace,
                                   then wait forever
scripted.py wait                   print "ready", wait for stdin to close, exit 0
scripted.py calls JSON             make the calls in JSON (a list of
                                   [call_id, tool, args]) with guest_client and
                                   print one JSON line per call
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def make_calls(spec: list[list[object]]) -> None:
    from guest_client import EffectUnknown, HostcallError, RetryPolicy, connect

    client = connect(retry=RetryPolicy(attempts=3, deadline=30.0))
    print(json.dumps({"pid": os.getpid()}), flush=True)
    for call_id, tool, args in spec:
        if tool == "__plan__":
            print(json.dumps({"plan": client.plan()}), flush=True)
            continue
        try:
            result = client.call(str(tool), args, call_id=str(call_id))  # type: ignore[arg-type]
            line: dict[str, object] = {"call_id": call_id, "result": result}
        except EffectUnknown as exc:
            line = {"call_id": call_id, "unknown": exc.idempotency_key, "code": exc.code}
        except HostcallError as exc:
            line = {"call_id": call_id, "error": exc.code}
        print(json.dumps(line), flush=True)


def main() -> None:
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "selfkill":
        os.kill(os.getpid(), int(sys.argv[2]))
    elif mode == "tree":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        escaped = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
        pids = {"guest": os.getpid(), "child": child.pid, "escaped": escaped.pid}
        if len(sys.argv) > 2:
            with open(sys.argv[2], "w") as f:
                json.dump(pids, f)
        pidns = int(os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]"))
        print(json.dumps({**pids, "pidns": pidns}), flush=True)
        print("ready", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # make the KILL step necessary
        time.sleep(600)
    elif mode == "wait":
        print("ready", flush=True)
        sys.stdin.read()
    elif mode == "calls":
        make_calls(json.loads(sys.argv[2]))
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
