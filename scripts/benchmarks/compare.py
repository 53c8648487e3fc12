"""Two versions of hostcall side by side: one point, alternating, pair by pair.

On a shared VM two runs of the same code differ by up to ~15 %, more than
most changes are worth; only a comparison within pairs run back to back
shows them. This runs ``hostcall run --no-sandbox --store STORE`` of each
version with the load generator as its guest, at one number of calls in
flight, ``--pairs`` times (which goes first alternates), and prints each
side's median and the median of the per-pair ratios (new ÷ old):

    python scripts/benchmarks/compare.py --base HEAD~3            # this tree against HEAD~3
    python scripts/benchmarks/compare.py --base v1 --head /src/b --store sqlite --inflight 32

``--base``/``--head`` take a directory or a git revision (checked out in a
temporary worktree, removed afterwards). Without the sandbox the guest can
see the supervisor, its parent, and reads its CPU itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

HERE: Final = Path(__file__).resolve().parent
ROOT: Final = HERE.parents[1]
#: What is compared, from each pair's load-generator point.
METRICS: Final = ("calls_per_s", "p50_us", "p99_us", "server_cpu_us_per_call")
#: One side's run: warm-up, window and the supervisor's start, with room to spare.
RUN_TIMEOUT_S: Final = 120.0


@contextlib.contextmanager
def checked_out(spec: str) -> Iterator[Path]:
    """``spec`` as a directory: itself, or a git revision of this repository
    checked out in a temporary worktree for as long as the block runs."""
    if Path(spec).is_dir():
        yield Path(spec).resolve()
        return
    scratch = Path(tempfile.mkdtemp(prefix="hostcall-compare-"))
    tree = scratch / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), spec],
        check=True,
        timeout=60,
    )
    try:
        yield tree
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
            check=False,
            timeout=60,
        )
        shutil.rmtree(scratch, ignore_errors=True)


def run_side(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``hostcall run`` of ``tree``'s code; the load generator's point."""
    loadgen = tree / "scripts" / "benchmarks" / "loadgen.py"
    options = ["--tools", args.tool, "--inflight", str(args.inflight)]
    window = ["--warmup", str(args.warmup), "--duration", str(args.duration)]
    command = shlex.join([sys.executable, str(loadgen), *options, *window])
    # sh only to hand over its parent's pid, the supervisor's; exec keeps the guest's.
    guest = f"exec {command} --server-pid $PPID"
    with tempfile.TemporaryDirectory(prefix="hostcall-compare-state-") as state:
        argv = [
            sys.executable,
            "-m",
            "supervisor.cli",
            "run",
            "--state-dir",
            state,
            "--store",
            args.store,
            "--plan",
            str(tree / "scripts" / "benchmarks" / "plan.toml"),
            "--no-sandbox",
            "--",
            "sh",
            "-c",
            guest,
        ]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run(
            argv, cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"compare: {tree}: hostcall run failed:\n{done.stderr[-2000:]}")
    point: dict[str, Any] = json.loads(lines[-1])["points"][0]
    if point["errors"] or not point["calls"]:
        raise SystemExit(f"compare: {tree}: calls failed: {point.get('first_error')}")
    return point


def compare(base: Path, head: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``args.pairs`` pairs, the side that goes first alternating."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for n in range(args.pairs):
        if n % 2 == 0:
            old = run_side(base, args)
            new = run_side(head, args)
        else:
            new = run_side(head, args)
            old = run_side(base, args)
        pairs.append((old, new))
    summary = {}
    for metric in METRICS:
        ratios = [new[metric] / old[metric] for old, new in pairs if old[metric]]
        summary[metric] = {
            "base_median": statistics.median(old[metric] for old, _ in pairs),
            "head_median": statistics.median(new[metric] for _, new in pairs),
            "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
            "ratios": [round(r, 3) for r in ratios],
        }
    return {
        "base": str(base),
        "head": str(head),
        "store": args.store,
        "inflight": args.inflight,
        "tool": args.tool,
        "pairs": args.pairs,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, compare, print (and write ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="directory or git revision (the old side)")
    parser.add_argument("--head", default=str(ROOT), help="directory or git revision (new side)")
    parser.add_argument("--store", default="memory", choices=["memory", "sqlite"])
    parser.add_argument("--inflight", type=int, default=1)
    parser.add_argument("--tool", default="noop")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds per run")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    with checked_out(args.base) as base, checked_out(args.head) as head:
        result = compare(base, head, args)
    print(
        f"{args.store} store, {args.inflight} in flight, {args.tool}, {args.pairs} pair(s): "
        f"{result['base']} -> {result['head']}"
    )
    for metric, row in result["summary"].items():
        print(
            f"  {metric}: {row['base_median']:.1f} -> {row['head_median']:.1f}, "
            f"new ÷ old {row['ratio_median']} (pairs {row['ratios']})"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
