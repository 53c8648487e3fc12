"""The CLI as an operator meets it (issue 14): what it says while it runs, the
commands people reach for, one-line errors, a fast start.

Real ``hostcall`` processes, real guests, real state dirs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from supervisor.admin_client import AdminClient
from tests.harness import STEP_TIMEOUT_S, read_line, without_hostcall_env

GUEST = Path(__file__).parents[1] / "guests" / "scripted.py"
HOSTCALL = Path(sys.executable).with_name("hostcall")
TOOLS = """
from supervisor import tool

@tool(reversibility="reversible")
def echo(text: str) -> str:
    return text

@tool(reversibility="irreversible", approval="always")
def charge(account: str, cents: int) -> dict:
    return {"charged": account, "cents": cents}

@tool(reversibility="reversible")
def boom(x: int) -> int:
    raise ValueError(f"no such thing as {x}")

@tool(reversibility="reversible")
def complain(text: str) -> str:
    raise ValueError(f"cannot use {text}")
"""
PLAN = """
[plan]
name = "operator"
approval_timeout_s = 120

[tools.echo]
handler = "op_tools:echo"

[tools.charge]
handler = "op_tools:charge"

[tools.boom]
handler = "op_tools:boom"

[tools.complain]
handler = "op_tools:complain"
"""


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "op_tools.py").write_text(TOOLS)
    (folder / "plan.toml").write_text(PLAN)
    return folder / "plan.toml"


def hostcall(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S * 2,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )


def guest_calls(*calls: tuple[str, str, dict[str, object]]) -> list[str]:
    return [sys.executable, str(GUEST), "calls", json.dumps([list(c) for c in calls])]


def a_new_terminal(cwd: Path) -> dict[str, str]:
    """The environment of a shell just opened: no venv on PATH, no HOSTCALL_*."""
    env = {**without_hostcall_env(), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.pop("VIRTUAL_ENV", None)
    return env


def read_until(stream: object, pattern: str) -> tuple[re.Match[str], list[str]]:
    """Lines of ``stream`` up to the first matching ``pattern`` (bounded)."""
    seen = []
    deadline = time.monotonic() + STEP_TIMEOUT_S * 2
    while time.monotonic() < deadline:
        line = read_line(stream)
        seen.append(line)
        if found := re.search(pattern, line):
            return found, seen
    raise AssertionError(f"no line matched {pattern!r}: {seen}")


@contextlib.contextmanager
def running(*argv: str, **kwargs: object) -> Iterator[subprocess.Popen[str]]:
    options: dict[str, object] = {"stdin": subprocess.DEVNULL, **kwargs}
    process = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **options,  # type: ignore[call-overload]
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STEP_TIMEOUT_S)
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()


# -- a fast start ----------------------------------------------------------------

HEAVY = ("aiohttp", "pydantic", "supervisor.supervisor", "asyncpg", "uvloop")


@pytest.mark.parametrize(
    "argv",
    [("--help",), ("--version",), ("approvals", "list"), ("run", "--help")],
    ids=lambda a: " ".join(a),
)
def test_help_version_and_approvals_list_load_nothing_heavy(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "supervisor.cli", *argv,
         "--state-dir", str(tmp_path)] if argv[0] == "approvals" else
        [sys.executable, "-X", "importtime", "-m", "supervisor.cli", *argv],
        capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False,
    )  # fmt: skip
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert not [m for m in HEAVY if m in loaded], sorted(m for m in HEAVY if m in loaded)


def test_version_names_the_installed_distribution() -> None:
    done = hostcall("--version")
    assert done.returncode == 0
    assert re.fullmatch(r"hostcall \d+\.\d+\.\d+\S*\n", done.stdout), done.stdout


# -- one line for every mistake ----------------------------------------------------


def mistakes(tmp: Path, plan: Path) -> list[tuple[str, list[str], int, str]]:
    afile = tmp / "a-file"
    afile.write_text("not a folder")
    script = tmp / "not-executable.sh"
    script.write_text("echo hi\n")
    unannotated = tmp / "unannotated"
    unannotated.mkdir()
    (unannotated / "bad_tools.py").write_text("def lookup(account):\n    return account\n")
    (unannotated / "plan.toml").write_text('[tools.lookup]\nhandler = "bad_tools:lookup"\n')
    misspelt = tmp / "misspelt.toml"
    misspelt.write_text('[plan]\nname = "x"\nmax_call = 3\n')
    state = ["--state-dir", str(tmp / "st")]
    run = ["run", *state, "--plan", str(plan)]
    return [
        ("unknown store", [*run, "--store", "mysql://x", "--", "true"], 2, "unknown store"),
        (
            "state dir is a file",
            ["run", "--state-dir", str(afile), "--plan", str(plan), "--", "true"],
            2,
            "is a file",
        ),
        (
            "state dir cannot be made",
            ["run", "--state-dir", "/proc/no/such", "--plan", str(plan), "--", "true"],
            2,
            "cannot create state dir",
        ),
        ("not executable", [*run, "--", str(script)], 126, "Permission denied"),
        ("missing command", [*run, "--", str(tmp / "nope")], 127, "No such file"),
        (
            "missing plan",
            ["run", *state, "--plan", str(tmp / "no.toml"), "--", "true"],
            2,
            "no plan file",
        ),
        ("run without --", [*run], 2, "after --"),
        (
            "nothing listens",
            [*run, "--store", "postgresql://u@127.0.0.1:1/db", "--", "true"],
            2,
            "PostgreSQL",
        ),
        (
            "receipts of no file",
            ["receipts", "verify", str(tmp / "none.jsonl"), *state],
            2,
            "cannot read",
        ),
        ("receipts of a folder", ["receipts", "verify", str(tmp), *state], 2, "not a receipt file"),
        (
            "receipts of an unknown invocation",
            ["receipts", "verify", "inv_none", *state],
            2,
            "no receipts of an invocation inv_none",
        ),
        ("no supervisor", ["approvals", "list", *state], 2, "no supervisor is running"),
        ("bad option", [*run, "--attempts", "zero", "--", "true"], 2, "--attempts"),
        ("unknown command", ["frobnicate"], 2, "invalid choice"),
        (
            "unannotated parameter",
            ["run", *state, "--plan", str(unannotated / "plan.toml"), "--", "true"],
            2,
            "parameter 'account' has no type",
        ),
        (
            "misspelt key",
            ["run", *state, "--plan", str(misspelt), "--", "true"],
            2,
            "did you mean 'max_calls'",
        ),
        ("console not loopback", [*run, "--console", "0.0.0.0:1", "--", "true"], 2, "loopback"),
        ("bad gc age", ["gc", "--older-than", "soon", *state], 2, "not an age"),
        # The id syntax allows "..", but an invocation id names a folder and a file.
        ("invocation ..", [*run, "--invocation", "..", "--", "true"], 2, "not . or .."),
    ]


def test_every_mistake_ends_in_one_line_with_its_exit_code_and_no_traceback(
    tmp_path: Path, plan_file: Path
) -> None:
    failures = []
    for name, argv, code, phrase in mistakes(tmp_path, plan_file):
        done = hostcall(*argv)
        lines = [
            line
            for line in done.stderr.splitlines()
            if not line.startswith("hostcall: invocation inv_")  # the start line of a run
        ]
        ok = done.returncode == code and len(lines) == 1 and phrase in lines[0]
        if not ok or "Traceback" in done.stderr:
            failures.append((name, done.returncode, done.stderr))
    assert failures == []


def test_a_plan_weaker_than_its_handlers_tag_is_a_warning_and_the_tag_holds(
    tmp_path: Path, plan_file: Path
) -> None:
    weaker = 'handler = "op_tools:charge"\nreversibility = "reversible"'
    plan_file.write_text(PLAN.replace('handler = "op_tools:charge"', weaker))
    done = hostcall(
        "run", "--state-dir", str(tmp_path / "st"), "--plan", str(plan_file), "--",
        *guest_calls(("p", "__plan__", {})),
    )  # fmt: skip
    plan = json.loads(done.stdout.splitlines()[1])["plan"]
    charge = next(t for t in plan["tools"] if t["name"] == "charge")
    assert done.returncode == 0, done.stderr
    assert "the plan says reversible, but its handler is tagged irreversible" in done.stderr
    assert charge["reversibility"] == "irreversible"


def test_a_foreign_supervisor_package_beside_ours_is_named_in_one_line(tmp_path: Path) -> None:
    """supervisord's package shares the import name: installed into the same
    folder, hostcall says so instead of failing in ways that name neither."""
    import supervisor

    copy = tmp_path / "site" / "supervisor"
    shutil.copytree(Path(supervisor.__file__).parent, copy)
    (copy / "supervisord.py").write_text("# supervisord's\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "--help"],
        capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    library = subprocess.run(
        [sys.executable, "-c", "from supervisor import Supervisor"],
        capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "supervisord" in done.stderr and "venv" in done.stderr
    assert "supervisord" in library.stderr  # an ImportError that says why


# -- what it says while it runs ------------------------------------------------------


def test_a_waiting_approval_is_announced_with_a_command_that_works_in_a_new_terminal(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "state dir"  # a space: the printed command must quote it
    guest = guest_calls(("c1", "charge", {"account": "acct_1", "cents": 500}))
    with running("run", "--state-dir", str(state), "--plan", str(plan_file), "--", *guest) as run:
        start, _ = read_until(run.stderr, r"hostcall: invocation (inv_\w+), plan operator")
        waiting, _ = read_until(run.stderr, r"approval (apr_\w+) waiting: c1 charge (.*) — (.*)$")
        command = waiting.group(3).split("  (or: ")[0]
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        approved = subprocess.run(
            shlex.split(command), cwd=elsewhere, env=a_new_terminal(elsewhere),
            capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False,
        )  # fmt: skip
        decided, _ = read_until(run.stderr, r"approval apr_\w+ (approved) by (\w+)")
        out, err = run.communicate(timeout=STEP_TIMEOUT_S)
    assert approved.returncode == 0, approved.stderr
    assert '{"account":"acct_1","cents":500}' in waiting.group(2)
    assert "irreversible" in waiting.group(2)
    assert f"--state-dir {shlex.quote(str(state.absolute()))}" in command
    assert Path(shlex.split(command)[0]).name == "hostcall"
    assert decided.group(2) == "operator"
    assert run.returncode == 0, err
    assert json.loads(out.splitlines()[1]) == {
        "call_id": "c1",
        "result": {"charged": "acct_1", "cents": 500},
    }
    assert start.group(1).startswith("inv_")


def test_sigterm_stops_the_guest_and_prints_the_command_that_resumes_it(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "st"
    with running(
        "run", "--state-dir", str(state), "--plan", str(plan_file), "--",
        sys.executable, str(GUEST), "wait",
    ) as run:  # fmt: skip
        started, _ = read_until(run.stderr, r"hostcall: invocation (inv_\w+),")
        assert read_line(run.stdout).strip() == "ready"
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=STEP_TIMEOUT_S)
    invocation = started.group(1)
    resume = re.search(rf"Invocation {invocation} resumes with: (.*)$", err, re.M)
    assert run.returncode == 128 + signal.SIGTERM
    assert resume is not None, err
    again = subprocess.run(
        shlex.split(resume.group(1)), stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=STEP_TIMEOUT_S * 2, check=False, env=a_new_terminal(tmp_path),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert f"invocation {invocation} (resumed)" in again.stderr


def test_json_goes_to_a_file_or_stdout_apart_from_the_guests_output(
    tmp_path: Path, plan_file: Path
) -> None:
    state = str(tmp_path / "st")
    guest = guest_calls(("c1", "echo", {"text": "hi"}))
    out_file = tmp_path / "outcome.json"
    to_file = hostcall("run", "--state-dir", state, "--plan", str(plan_file),
                       "--json", str(out_file), "--", *guest)  # fmt: skip
    to_stdout = hostcall("run", "--state-dir", state, "--plan", str(plan_file),
                         "--json", "-", "--", *guest)  # fmt: skip
    assert to_file.returncode == 0 and to_stdout.returncode == 0
    saved = json.loads(out_file.read_text())
    printed = json.loads(to_stdout.stdout.splitlines()[-1])
    for outcome in (saved, printed):
        assert outcome["exit_status"] == 0
        assert outcome["executions"][0]["calls"] == {"executed": 1}
    assert "exited with 0" in to_file.stderr  # the human summary stays on stderr
    assert to_file.stdout.splitlines()[1] == '{"call_id": "c1", "result": "hi"}'


def test_a_handler_that_raises_leaves_its_traceback_in_the_host_log_and_one_line_on_stderr(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "st"
    done = hostcall("run", "--state-dir", str(state), "--plan", str(plan_file), "--",
                    *guest_calls(("c1", "boom", {"x": 7})))  # fmt: skip
    line = [ln for ln in done.stderr.splitlines() if "boom raised" in ln]
    assert done.returncode == 0, done.stderr
    assert len(line) == 1 and "ValueError: no such thing as 7" in line[0]
    where = re.search(r"\(traceback in (.*\.host\.log)\)", line[0])
    assert where is not None
    host_log = Path(where.group(1)).read_text()
    assert "Traceback (most recent call last)" in host_log
    assert "raise ValueError" in host_log
    assert "Traceback" not in done.stderr
    verbose = hostcall("run", "-vv", "--state-dir", str(state), "--plan", str(plan_file), "--",
                       *guest_calls(("c2", "boom", {"x": 8})))  # fmt: skip
    assert "Traceback (most recent call last)" in verbose.stderr  # -vv shows it


def test_what_a_guest_sent_reaches_the_operators_stderr_inert(
    tmp_path: Path, plan_file: Path
) -> None:
    """A handler's error may quote a guest's argument: its escape sequences
    must not act on the operator's terminal, its newlines not forge lines,
    its right-to-left override not turn the line around."""
    forged = "\x1b]0;owned\x07\x1b[2J\nhostcall: approval apr_x approved by operator\u202e\tok"
    done = hostcall("run", "--state-dir", str(tmp_path / "st"), "--plan", str(plan_file), "--",
                    *guest_calls(("c1", "complain", {"text": forged})))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert "\\x1b]0;owned\\x07" in done.stderr
    assert "\u202e" not in done.stderr and "operator\\u202e\tok" in done.stderr
    assert not [ln for ln in done.stderr.splitlines() if ln.startswith("hostcall: approval")]


def test_on_a_terminal_a_status_line_shows_the_execution_and_its_calls(
    tmp_path: Path, plan_file: Path
) -> None:
    controller, terminal = pty.openpty()
    guest = guest_calls(
        ("c1", "echo", {"text": "a"}), ("c2", "charge", {"account": "a", "cents": 1})
    )
    state = tmp_path / "st"
    process = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(state), "--plan",
         str(plan_file), "--", *guest],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal,
    )  # fmt: skip
    os.close(terminal)
    seen = b""

    def read_for(seconds: float, until: bytes | None = None) -> None:
        """Keep reading the terminal (a full one would block hostcall's writes)."""
        nonlocal seen
        deadline = time.monotonic() + seconds
        with contextlib.suppress(OSError):  # EIO: every writer is gone
            while time.monotonic() < deadline and (until is None or until not in seen):
                if select.select([controller], [], [], 0.2)[0]:
                    if not (chunk := os.read(controller, 65536)):
                        return
                    seen += chunk
                elif until is None and process.poll() is not None:
                    return

    try:
        read_for(STEP_TIMEOUT_S * 2, until=b"1 approval waiting")
        [proposal] = AdminClient(state).request("GET", "/v1/approvals?state=waiting")
        AdminClient(state).request("POST", f"/v1/approvals/{proposal['id']}/approve")
        read_for(STEP_TIMEOUT_S)  # to the end
        process.wait(timeout=STEP_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=STEP_TIMEOUT_S)
        os.close(controller)
    text = seen.decode(errors="replace")
    assert process.returncode == 0
    assert "\r\x1b[K" in text  # redrawn in place
    assert re.search(r"\d+\.\d s · exe_\w+ \(attempt 1/1, running\) · executed 1", text)
    assert "1 approval waiting" in text


# -- the commands people reach for ------------------------------------------------------


def test_the_operator_commands_against_a_running_serve(tmp_path: Path, plan_file: Path) -> None:
    state = tmp_path / "st"
    with running("serve", "--state-dir", str(state), "--plan", str(plan_file)) as serve:
        read_until(serve.stderr, r"admin:")
        launched = hostcall(
            "launch", "--state-dir", str(state), "--invocation", "inv_op", "--",
            *guest_calls(("c1", "echo", {"text": "hello"}), ("c2", "charge",
                                                              {"account": "a", "cents": 3})),
        )  # fmt: skip
        read_until(serve.stderr, r"launched exe_\w+ of inv_op")
        waiting, _ = read_until(serve.stderr, r"approval (apr_\w+) waiting")
        shown = hostcall("approvals", "show", waiting.group(1), "--state-dir", str(state))
        listed = hostcall("invocations", "--state-dir", str(state))
        as_json = hostcall("invocations", "--json", "--state-dir", str(state))
        listed_json = json.loads(as_json.stdout)
        [execution] = listed_json[0]["executions"]
        revoked = hostcall("revoke", "inv_op", "echo", "--state-dir", str(state))
        cancelled = hostcall("cancel", execution["execution_id"], "--state-dir", str(state))
        again = hostcall("cancel", execution["execution_id"], "--state-dir", str(state))
        read_until(serve.stderr, rf"inv_op execution {execution['execution_id']} was cancelled")
        calls = hostcall("calls", "inv_op", "--state-dir", str(state))
        logs = hostcall("logs", "inv_op", "--state-dir", str(state))
        verified = hostcall("receipts", "verify", "inv_op", "--state-dir", str(state))
    assert launched.returncode == 0 and "launched exe_" in launched.stdout
    assert shown.returncode == 0
    assert '"account": "a"' in shown.stdout and "reversibility:" in shown.stdout
    assert listed.returncode == 0 and "inv_op" in listed.stdout
    assert listed_json[0]["invocation_id"] == "inv_op"
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    assert again.returncode == 1 and again.stderr.count("\n") == 1  # one line: not live
    assert calls.returncode == 0 and "c1" in calls.stdout and "committed" in calls.stdout
    assert logs.returncode == 0 and '"result": "hello"' in logs.stdout
    assert verified.returncode == 0, verified.stderr
    assert "hash chain intact" in verified.stdout


def test_logs_follow_prints_as_the_guest_writes_and_ends_with_its_invocation(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "st"
    with running(
        "run", "--state-dir", str(state), "--plan", str(plan_file), "--invocation", "inv_f",
        "--", sys.executable, "-u", "-c",
        "import sys; print('first', flush=True); sys.stdin.readline(); print('second')",
        stdin=subprocess.PIPE,
    ) as run:  # fmt: skip
        assert read_line(run.stdout).strip() == "first"
        follow = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "logs", "inv_f", "--follow", "--state-dir",
             str(state), "--stream", "stdout"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            read_until(follow.stdout, r"^first$")
            assert run.stdin is not None
            run.stdin.write("\n")
            run.stdin.close()
            read_until(follow.stdout, r"^second$")
            follow.wait(timeout=STEP_TIMEOUT_S)  # the invocation ended: so does --follow
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait()
            assert follow.stdout is not None
            follow.stdout.close()
    assert follow.returncode == 0


def _read_pty_until(controller: int, needle: bytes, seen: bytearray) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {bytes(seen)!r}"
        if select.select([controller], [], [], left)[0]:
            seen += os.read(controller, 65536)


def test_logs_follow_on_a_terminal_keeps_a_character_and_a_line_split_between_writes_whole(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "st"
    guest = (
        "import os, sys; os.write(1, b'ready\\n'); os.write(1, b'one caf\\xc3');"
        " sys.stdin.readline(); os.write(1, b'\\xa9 two\\n')"
    )
    with running(
        "run", "--state-dir", str(state), "--plan", str(plan_file), "--invocation", "inv_t",
        "--", sys.executable, "-c", guest, stdin=subprocess.PIPE,
    ) as run:  # fmt: skip
        assert read_line(run.stdout).strip() == "ready"
        controller, terminal = pty.openpty()
        follow = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "logs", "inv_t", "--follow", "--state-dir",
             str(state), "--stream", "stdout"],
            stdin=subprocess.DEVNULL, stdout=terminal, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(terminal)
        seen = bytearray()
        try:
            _read_pty_until(controller, b"one caf", seen)
            assert run.stdin is not None
            run.stdin.write("\n")
            run.stdin.close()
            _read_pty_until(controller, b"two", seen)
            follow.wait(timeout=STEP_TIMEOUT_S)  # the invocation ended: so does --follow
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait()
            os.close(controller)
    assert follow.returncode == 0
    assert "one caf\u00e9 two".encode() in seen, bytes(seen)  # before: caf\xc3, then a new line


def test_gc_deletes_logs_and_forgets_records_only_past_their_deadline(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "st"
    for invocation, deadline in (("inv_past", "2"), ("inv_open", None)):
        limit = f"approval_timeout_s = 120\ndeadline_s = {deadline}" if deadline else ""
        plan_file.write_text(PLAN.replace("approval_timeout_s = 120", limit) if limit else PLAN)
        guest = guest_calls(("c1", "echo", {"text": "x"}))
        done = hostcall(
            "run", "--state-dir", str(state), "--plan", str(plan_file), "--invocation",
            invocation, "--", *guest,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    past_deadline = time.time() + 3
    while time.time() < past_deadline:  # inv_past's 2 s deadline must pass: a clock, not an order
        time.sleep(0.2)
    dry = hostcall("gc", "--older-than", "0s", "--dry-run", "--state-dir", str(state))
    assert (state / "logs" / "inv_past").exists()
    done = hostcall("gc", "--older-than", "0s", "--state-dir", str(state))
    past = hostcall("calls", "inv_past", "--json", "--state-dir", str(state))
    still = hostcall("calls", "inv_open", "--json", "--state-dir", str(state))
    resumed = hostcall("run", "--state-dir", str(state), "--plan", str(plan_file),
                       "--invocation", "inv_open", "--",
                       *guest_calls(("c1", "echo", {"text": "x"})))  # fmt: skip
    assert dry.returncode == 0 and "would delete 1 effect record(s)" in dry.stdout
    assert done.returncode == 0, done.stderr
    assert "deleted the guest logs of 2 invocation(s)" in done.stdout
    assert "deleted 1 effect record(s) of 1 invocation(s) whose deadline has passed" in done.stdout
    assert "kept the effect records of 1 invocation(s)" in done.stdout
    assert "kept every receipt file" in done.stdout
    assert json.loads(past.stdout) == []
    assert [r["call_id"] for r in json.loads(still.stdout)] == ["c1"]
    assert not (state / "logs" / "inv_past").exists()
    assert (state / "receipts" / "inv_past.jsonl").exists()
    # What gc kept is what makes a resume safe: the call is replayed, not run again.
    assert resumed.returncode == 0
    assert "calls: replayed 1" in resumed.stderr


def test_completion_prints_a_script_for_the_shell() -> None:
    done = hostcall("completion", "bash")
    assert done.returncode == 0
    assert "hostcall" in done.stdout and "complete" in done.stdout


def test_the_status_line_never_cuts_a_line_the_guest_has_not_finished(
    tmp_path: Path, plan_file: Path
) -> None:
    """A guest that writes half a line, then the rest a second later (a slow
    writer; the status line is redrawn about four times a second meanwhile):
    on the operator's terminal the line stays whole."""
    controller, terminal = pty.openpty()
    slow = (
        "import sys, time; sys.stderr.write('half a '); sys.stderr.flush(); "
        "time.sleep(1); sys.stderr.write('line\\n')"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(tmp_path / "st"),
         "--plan", str(plan_file), "--", sys.executable, "-c", slow],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal,
    )  # fmt: skip
    os.close(terminal)
    seen = b""
    try:
        with contextlib.suppress(OSError):  # EIO once hostcall is gone
            while select.select([controller], [], [], STEP_TIMEOUT_S)[0]:
                if not (chunk := os.read(controller, 65536)):
                    break
                seen += chunk
        process.wait(timeout=STEP_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=STEP_TIMEOUT_S)
        os.close(controller)
    assert process.returncode == 0
    assert b"half a line" in seen, seen
    assert b"\r\x1b[K" in seen  # there was a status line, drawn around it


#: What a guest can put in a string argument to mislead an operator reading
#: it: a C1 CSI (a terminal's escape, in UTF-8), DEL, a right-to-left override
#: (shows the text after it reversed), a zero-width space, an invisible tag
#: character (text a model reads and a person does not), a line separator,
#: a Hangul filler and a variation selector (both drawn as nothing).
MISLEADING: Final = "acct\u009b2J\x7f\u202e01\u200b\U000e0041\u2028\u3164\U000e0101end"
UNSEEN: Final = ("\u009b", "\x7f", "\u202e", "\u200b", "\U000e0041", "\u2028", "\u3164",
                 "\U000e0101")  # fmt: skip


def test_an_argument_a_guest_wrote_is_shown_to_the_deciding_operator_inert(
    tmp_path: Path, plan_file: Path
) -> None:
    """Approvals are decided on what the CLI shows: characters that act on a
    terminal or change what the text looks like are shown as JSON escapes,
    and what is shown is still the JSON of the very arguments."""
    state = tmp_path / "st"
    with running("serve", "--state-dir", str(state), "--plan", str(plan_file)) as serve:
        read_until(serve.stderr, r"admin:")
        hostcall(
            "launch", "--state-dir", str(state), "--invocation", "inv_bidi", "--",
            *guest_calls(("c1", "echo", {"text": MISLEADING}),
                         ("c2", "charge", {"account": MISLEADING, "cents": 3})),
        )  # fmt: skip
        waiting, _ = read_until(serve.stderr, r"approval (apr_\w+) waiting")
        shown = hostcall("approvals", "show", waiting.group(1), "--state-dir", str(state))
        listed = hostcall("approvals", "list", "--state-dir", str(state))
        calls = hostcall("calls", "inv_bidi", "--state-dir", str(state))
    for done in (shown, listed, calls):
        assert done.returncode == 0, done.stderr
        assert not [c for c in UNSEEN if c in done.stdout], done.stdout
    escaped = "\\u009b2J\\u007f\\u202e01\\u200b\\udb40\\udc41\\u2028\\u3164\\udb40\\udd01end"
    assert escaped in shown.stdout
    args = json.loads(shown.stdout.split("args:\n", 1)[1])
    assert args == {"account": MISLEADING, "cents": 3}
    assert "acct\\u009b2J" in listed.stdout and "acct\\u009b2J" in calls.stdout
