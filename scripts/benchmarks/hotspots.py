"""Where the supervisor's time goes per call: py-spy on a running ``hostcall run``.

Starts ``hostcall run --store STORE`` with the load generator as its guest at
one number of calls in flight, attaches py-spy to the supervisor once the
warm-up is over, samples it (without pausing it) for a while, and prints the
functions with the largest share of the samples: inclusive (the function and
everything it calls) and self (the function's own code).

    python scripts/benchmarks/hotspots.py --store memory --inflight 32
    python scripts/benchmarks/hotspots.py --store sqlite --inflight 1 --tool noop_sync
    python scripts/benchmarks/hotspots.py --store memory --inflight 32 --no-sandbox

Needs py-spy (``pip install -e '.[bench]'``) and the right to ptrace the child:
the supervisor makes itself non-dumpable (SPEC §13), so only a user with
``CAP_SYS_PTRACE`` (root) can attach, whatever ``ptrace_scope`` says.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from loadgen import last_json, point_args
from run import hostcall_run_argv

HERE: Final = Path(__file__).resolve().parent
ROOT: Final = HERE.parents[1]
#: Frames that are plumbing, not a place to optimise: left out of the tables.
_PLUMBING: Final = frozenset(
    {
        "<module>",
        "_run_module_as_main",
        "_run_code",
        "main",
        "_run_main",
        "run",
        "run_until_complete",
        "run_forever",
        "_run_once",
        "_run",
        "guarded",
        "_bootstrap",
        "_bootstrap_inner",
        "_worker",
        "worker",
        "__step",
        "__step_run_and_handle_result",
        "__wakeup",
    }
)
#: Stages of the per-call path: a sample belongs to the stage of the innermost
#: frame that matches (checked leaf first), else to the last stage.
STAGES: Final = (
    ("tree sampling (psutil over /proc, every 100 ms)", r"TreeTracker\.|process_map|GuestTree\."),
    ("receipt write + fsync (worker thread)", r"ReceiptLog\._write"),
    ("receipt: hash chain, JCS, queueing", r"ReceiptLog\.|Broker\._receipt"),
    ("idempotency key (JCS + sha256)", r"_key_of|idempotency_key"),
    ("canonicalize args (pydantic)", r"Tool\.canonicalize|Tool\.bind"),
    ("effect store", r"EffectStore\.|SQLiteEffectStore|_run_batch|_serve \(supervisor"),
    ("result check (output schema, JCS)", r"_checked_result"),
    ("metrics", r"Metrics\."),
    ("identity + origin check", r"ChannelServer\._identify|authenticate|check_origin"),
    ("frame: read body, parse JSON", r"_read_body|parse_call_request"),
    ("reply JSON", r"_json_response|CallReply\."),
    ("broker: admission, dispatch task, shield", r"Broker\."),
    ("handler (the no-op, and the sync call in its thread)", r"_call_sync|bench_tools"),
    ("aiohttp: HTTP parse, routing, write", r"aiohttp/"),
    ("event loop (uvloop's C code: epoll, socket I/O, callbacks)", r"^Runner\.run \(asyncio"),
    ("worker threads: wake-up and hand-off", r"^_worker \(concurrent|^Thread\."),
    ("other", r""),
)
_FRAME: Final = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
#: Bound on the run beyond its own warm-up and sampling time.
SLACK_S: Final = 60.0


def _frame_name(frame: str) -> str:
    match = _FRAME.match(frame)
    if match is None:
        return frame
    path = match.group("file")
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match.group('func')} ({path})"


def _stage(frames: list[str], patterns: list[tuple[str, re.Pattern[str]]]) -> str:
    for frame in reversed(frames):
        for name, pattern in patterns[:-1]:
            if pattern.search(frame):
                return name
    return patterns[-1][0]


def summarize(raw: str, top: int) -> str:
    """Inclusive and self shares of the samples in py-spy's raw (collapsed) output."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    stages: collections.Counter[str] = collections.Counter()
    patterns = [(name, re.compile(pattern)) for name, pattern in STAGES]
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
        stages[_stage(frames, patterns)] += count
    if not total:
        return "no samples"

    def rows(counter: collections.Counter[str]) -> list[str]:
        chosen = [
            (name, count)
            for name, count in counter.most_common()
            if name.split(" (")[0].split(".")[-1] not in _PLUMBING
        ][:top]
        return [f"| {100 * count / total:5.1f} % | `{name}` |" for name, count in chosen]

    return "\n".join(
        [
            f"{total} samples",
            "",
            "by stage of the call path (innermost matching frame):",
            "",
            "| share | stage |",
            "|--:|---|",
            *[
                f"| {100 * stages[name] / total:5.1f} % | {name} |"
                for name, _ in STAGES
                if stages[name]
            ],
            "",
            "inclusive (the function and what it calls):",
            "",
            "| share | function |",
            "|--:|---|",
            *rows(inclusive),
            "",
            "self (the function's own code):",
            "",
            "| share | function |",
            "|--:|---|",
            *rows(own),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Profile one point and print the hot spots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="memory")
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--tool", default="noop")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to sample")
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--raw", type=Path, help="also keep py-spy's raw output here")
    parser.add_argument(
        "--no-sandbox", dest="sandbox", action="store_false", help="the guest without its sandbox"
    )
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("hotspots: py-spy is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    warmup_s = 3.0
    with tempfile.TemporaryDirectory(prefix="hostcall-profile-") as scratch:
        work = Path(scratch)
        options = point_args(args.tool, [args.inflight], warmup_s, args.seconds + 2)
        guest = [sys.executable, str(HERE / "loadgen.py"), *options]
        argv = hostcall_run_argv(work / "state", args.store, guest, sandbox=args.sandbox)
        # The load generator's results come out on the supervisor's stdout.
        supervisor = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        try:
            time.sleep(warmup_s)  # startup and the load generator's own warm-up
            raw = work / "profile.txt"
            subprocess.run(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(supervisor.pid),
                    "--nonblocking",
                    "--rate",
                    str(args.rate),
                    "--duration",
                    str(int(args.seconds)),
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                ],
                check=True,
                timeout=args.seconds + SLACK_S,
                capture_output=True,
            )
            stdout, _ = supervisor.communicate(timeout=warmup_s + args.seconds + SLACK_S)
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
                supervisor.communicate()
        text = raw.read_text()
        if args.raw is not None:
            args.raw.write_text(text)
        try:
            load = last_json(stdout)["points"]
        except ValueError:
            load = "no results"
    sandbox = "" if args.sandbox else " --no-sandbox"
    print(f"hostcall run{sandbox} --store {args.store}, {args.tool}, {args.inflight} in flight")
    print(f"load generator: {load}")
    print(summarize(text, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
