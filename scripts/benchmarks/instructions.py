"""The supervisor's instructions per call: a count that does not move with the host.

Calls/s and CPU time on a shared VM move by 15 % between runs of the same
code, more than most changes are worth (``compare.py`` needs a dozen pairs to
see 5 %). ``valgrind --tool=callgrind`` counts the instructions the
supervisor executes instead, which is the same for the same code and inputs
whatever else the machine does. This runs a supervisor (this script's
``--serve``, on the benchmark plan, no sandbox) under callgrind twice — its
guest making ``N1`` and then ``N2`` calls of the no-op tool, one at a time —
and reports ``(I(N2) − I(N1)) ÷ (N2 − N1)``: the start, the launch and the
shutdown cancel out, what is left is one call's work in the supervisor
(channel, broker, store, receipt, reply; the guest is not counted, and the
channel identifies the peer without a pidfd, as on Linux before 6.5:
valgrind does not know them).

    python scripts/benchmarks/instructions.py                 # memory store
    python scripts/benchmarks/instructions.py --store sqlite --calls 100,600
    python scripts/benchmarks/instructions.py --base HEAD~2   # and an older tree, same counts

Instructions are not time: a system call counts once however long the
kernel takes, and a cache miss not at all. Use it to see whether a change
removed work from the per-call path, and ``compare.py`` for what that is
worth in time. Needs ``valgrind`` (Debian's package); about a minute per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

HERE: Final = Path(__file__).resolve().parent
ROOT: Final = HERE.parents[1]
PLAN: Final = HERE / "plan.toml"
#: One run under callgrind: the supervisor's start alone takes ~30 s there.
RUN_TIMEOUT_S: Final = 900.0
_SUMMARY: Final = re.compile(rb"^(?:summary|totals): (\d+)", re.MULTILINE)

#: The guest: ``N`` calls of ``noop``, one at a time, through the client shim.
GUEST: Final = """
import sys
from guest_client import connect

with connect() as client:
    for n in range(int(sys.argv[1])):
        assert client.call("noop", {"n": n}) == n
"""


async def serve(store: str, calls: int, state_dir: Path) -> int:
    """The supervisor side: run the guest once under the benchmark plan."""
    sys.path.insert(0, str(HERE))  # bench_tools, the plan's handlers
    import channel.identity
    import channel.peer
    from supervisor import Plan, Supervisor

    # valgrind knows neither SO_PEERPIDFD's pidfds nor pidfd_send_signal: the
    # channel takes its path for kernels before 6.5 (the same checks, no pin).
    channel.peer.peer_pidfd = channel.identity.peer_pidfd = lambda sock: None
    plan = Plan.load(PLAN)
    async with Supervisor(state_dir, store=store, sandbox=False) as supervisor:
        # The tree sampler walks /proc on a wall-clock timer; under callgrind a
        # run lasts ~50x longer, so its passes would count as the calls' work.
        supervisor._tracker.interval_s = 3600.0
        outcome = await supervisor.run(plan, [sys.executable, "-c", GUEST, str(calls)])
    return 0 if outcome.exit_code == 0 else 1


def count(tree: Path, store: str, calls: int, work: Path) -> int:
    """Instructions of one supervisor run whose guest makes ``calls`` calls."""
    out = work / f"callgrind-{store}-{calls}.out"
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        "--trace-children=no",
        sys.executable,
        # This script in any case (an older tree may have none): the tree's
        # packages come first on PYTHONPATH, ahead of the editable install.
        str(Path(__file__).resolve()),
        "--serve",
        "--store",
        store,
        "--calls",
        str(calls),
        "--state-dir",
        str(work / f"state-{calls}"),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)}
    done = subprocess.run(
        argv, env=env, capture_output=True, timeout=RUN_TIMEOUT_S, check=False, cwd=tree
    )
    if done.returncode != 0:
        sys.stderr.buffer.write(done.stderr[-4000:])
        raise SystemExit(f"instructions: the run with {calls} calls failed: {shlex.join(argv)}")
    match = _SUMMARY.search(out.read_bytes())
    if match is None:
        raise SystemExit(f"instructions: no total in {out}")
    return int(match.group(1))


def per_call(tree: Path, store: str, low: int, high: int) -> float:
    """Instructions per call of the tree at ``tree``."""
    with tempfile.TemporaryDirectory(prefix="hostcall-instructions-") as scratch:
        work = Path(scratch)
        return (count(tree, store, high, work) - count(tree, store, low, work)) / (high - low)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; serve, or measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="memory", choices=("memory", "sqlite"))
    parser.add_argument("--calls", default="100,600", help="N1,N2: the two runs' calls")
    parser.add_argument("--base", help="also count this tree (a directory or git revision)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        calls = int(args.calls)
        return uvloop.run(serve(args.store, calls, args.state_dir))
    if shutil.which("valgrind") is None:
        raise SystemExit("instructions: needs valgrind (Debian: apt-get install valgrind)")
    low, high = (int(n) for n in args.calls.split(","))
    if not 0 < low < high:
        parser.error("--calls must be N1,N2 with 0 < N1 < N2")
    trees = [("this tree", ROOT)]
    with _checked_out(args.base) as base:
        if base is not None:
            trees.insert(0, (f"base {args.base}", base))
        results = [(name, per_call(tree, args.store, low, high)) for name, tree in trees]
    for name, value in results:
        print(f"{args.store} store, {name}: {value:,.0f} instructions per call")
    if len(results) == 2:
        print(f"this tree ÷ base: {results[1][1] / results[0][1]:.4f}")
    return 0


def _checked_out(spec: str | None) -> contextlib.AbstractContextManager[Path | None]:
    """``spec`` as a directory (``compare.py``'s checkout), or ``None``."""
    if spec is None:
        return contextlib.nullcontext(None)
    from compare import checked_out

    return checked_out(spec)


if __name__ == "__main__":
    raise SystemExit(main())
