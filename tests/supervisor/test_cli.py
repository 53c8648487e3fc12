"""``hostcall run`` as a user runs it: a real CLI process, a real guest, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import STEP_TIMEOUT_S, TreeWatch, read_line

GUEST = Path(__file__).parents[1] / "guests" / "scripted.py"
TOOLS = """
from supervisor import tool

@tool(reversibility="reversible")
def echo(text: str) -> str:
    return text
"""


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "cli_tools.py").write_text(TOOLS)
    (folder / "plan.toml").write_text(
        '[plan]\nname = "cli"\nmax_calls = 5\n\n[tools.echo]\nhandler = "cli_tools:echo"\n'
        '\n[sandbox]\nread_write = ["../shared"]\n'
    )
    return folder / "plan.toml"


def hostcall(
    *args: str, timeout: float = STEP_TIMEOUT_S * 2, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )


def run_guest(
    state: Path, plan: Path, *guest: str, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return hostcall(
        "run",
        "--state-dir",
        str(state),
        "--plan",
        str(plan),
        *extra,
        "--",
        sys.executable,
        str(GUEST),
        *guest,
    )


def test_run_exits_with_the_guests_exit_code_and_summarises_on_stderr(
    tmp_path: Path, plan_file: Path
) -> None:
    done = run_guest(tmp_path / "st", plan_file, "exit", "3")
    assert done.returncode == 3
    assert "exited with 3" in done.stderr
    assert "invocation inv_" in done.stderr


def test_run_exits_128_plus_n_when_a_signal_ended_the_guest(
    tmp_path: Path, plan_file: Path
) -> None:
    done = run_guest(tmp_path / "st", plan_file, "selfkill", str(int(signal.SIGKILL)))
    assert done.returncode == 128 + signal.SIGKILL
    assert "signal 9" in done.stderr


def start_tree(state: Path, plan: Path, *extra: str) -> subprocess.Popen[str]:
    """``hostcall run -- scripted.py tree``, its output read as it comes."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "run",
            "--state-dir",
            str(state),
            "--plan",
            str(plan),
            *extra,
            "--",
            sys.executable,
            str(GUEST),
            "tree",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "no-sandbox"])
def test_a_timeout_exits_124_and_ends_the_whole_tree_including_a_setsid_grandchild(
    tmp_path: Path, plan_file: Path, sandbox: bool
) -> None:
    extra = ("--timeout", "2", *(() if sandbox else ("--no-sandbox",)))
    with start_tree(tmp_path / "st", plan_file, *extra) as hostcall_process:
        assert hostcall_process.stdout is not None
        watch = TreeWatch(json.loads(read_line(hostcall_process.stdout)), sandboxed=sandbox)
        try:
            _, stderr = hostcall_process.communicate(timeout=STEP_TIMEOUT_S)
            assert hostcall_process.returncode == 124
            assert "timeout" in stderr
            assert watch.alive() == []
        finally:
            watch.close()


def test_the_json_summary_is_machine_readable(tmp_path: Path, plan_file: Path) -> None:
    calls = json.dumps([["c1", "echo", {"text": "hi"}], ["c1", "echo", {"text": "hi"}]])
    done = run_guest(tmp_path / "st", plan_file, "calls", calls, extra=("--json",))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["exit_status"] == 0
    assert summary["invocation_id"].startswith("inv_")
    [execution] = summary["executions"]
    assert execution["reason"] == "exited"
    assert execution["calls"] == {"executed": 1, "replayed": 1}
    assert execution["peak_processes"] >= 1
    # The guest itself, however short: one that ended before the first sample said 0.
    short = hostcall(
        "run", "--state-dir", str(tmp_path / "st"), "--plan", str(plan_file), "--json",
        "--", "true",
    )  # fmt: skip
    assert json.loads(short.stderr.strip().splitlines()[-1])["executions"][0]["peak_processes"] == 1
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[1] == {"call_id": "c1", "result": "hi"}
    assert lines[2] == {"call_id": "c1", "result": "hi"}


def test_state_dir_is_taken_after_a_command_group_too(tmp_path: Path, plan_file: Path) -> None:
    """SPEC §9: `--state-dir DIR` after the subcommand's name — also after
    `approvals` / `receipts`, before their action, and before the command."""
    state = tmp_path / "st"
    done = run_guest(state, plan_file, "calls", json.dumps([["c1", "echo", {"text": "x"}]]))
    assert done.returncode == 0, done.stderr
    [receipts] = (state / "receipts").glob("inv_*.jsonl")
    elsewhere = {**os.environ, "HOSTCALL_STATE_DIR": str(tmp_path / "elsewhere")}
    for argv in (
        ("approvals", "--state-dir", str(state), "list"),
        ("approvals", "list", "--state-dir", str(state)),
        ("--state-dir", str(state), "approvals", "list"),
    ):
        # No supervisor runs there now: the message names the directory it used.
        listed = hostcall(*argv, env=elsewhere)
        assert listed.returncode == 2, listed.stderr
        assert f"no supervisor is running on {state}" in listed.stderr
    for argv in (
        ("receipts", "--state-dir", str(state), "verify", str(receipts)),
        ("receipts", "verify", str(receipts), "--state-dir", str(state)),
    ):
        verified = hostcall(*argv)
        assert verified.returncode == 0, verified.stderr


def test_receipts_of_a_run_on_another_store_are_verified_by_their_chain(
    tmp_path: Path, plan_file: Path
) -> None:
    """With ``--store sqlite:///elsewhere`` the state dir has no effects.db to
    check the receipts against: ``receipts verify --state-dir`` says so and
    checks the chain alone (it used to refuse, exit 2)."""
    state = tmp_path / "st"
    store = f"sqlite:///{tmp_path / 'other.db'}"
    calls = json.dumps([["c1", "echo", {"text": "x"}]])
    done = run_guest(
        state, plan_file, "calls", calls, extra=("--store", store, "--invocation", "inv_o")
    )
    assert done.returncode == 0, done.stderr
    verified = hostcall("receipts", "verify", "inv_o", "--state-dir", str(state))
    assert verified.returncode == 0, verified.stderr
    assert "checking the chain alone" in verified.stderr
    (state / "receipts" / "inv_o.jsonl").write_text("{}\n")  # and a broken chain still fails
    assert hostcall("receipts", "verify", "inv_o", "--state-dir", str(state)).returncode == 1


def test_a_state_dir_path_too_long_for_sun_path_still_works(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / ("d" * 60) / ("e" * 60) / "state"
    calls = json.dumps([["c1", "echo", {"text": "long"}]])
    done = run_guest(state, plan_file, "calls", calls)
    assert done.returncode == 0, done.stderr
    assert '"result": "long"' in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--invocation", "bad id!"), "ids are 1-128 characters"),
        (("--timeout", "0"), "must be greater than 0"),
        (("--attempts", "0"), "--attempts: must be at least 1"),
    ],
)
def test_bad_options_exit_2_with_a_message(
    tmp_path: Path, plan_file: Path, args: tuple[str, ...], message: str
) -> None:
    done = run_guest(tmp_path / "st", plan_file, "exit", "0", extra=args)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_missing_command_exits_2_and_an_unknown_one_127(tmp_path: Path, plan_file: Path) -> None:
    missing = hostcall("run", "--state-dir", str(tmp_path / "st"), "--plan", str(plan_file))
    unknown = hostcall(
        "run",
        "--state-dir",
        str(tmp_path / "st"),
        "--plan",
        str(plan_file),
        "--",
        str(tmp_path / "no-such-program"),
    )
    as_json = hostcall(
        "run", "--state-dir", str(tmp_path / "st"), "--plan", str(plan_file), "--json",
        "--", str(tmp_path / "no-such-program"),
    )  # fmt: skip
    assert missing.returncode == 2
    assert unknown.returncode == 127
    assert "cannot start" in unknown.stderr
    # --json still ends with its object, saying there was no execution.
    summary = json.loads(as_json.stderr.strip().splitlines()[-1])
    assert as_json.returncode == summary["exit_status"] == 127
    assert summary["executions"] == []
    assert "cannot start" in summary["error"]


def test_an_invalid_plan_exits_2_naming_the_problem(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text('[plan]\nname = "x"\nmax_calls = "many"\n')
    done = hostcall("run", "--state-dir", str(tmp_path / "st"), "--plan", str(plan), "--", "true")
    assert done.returncode == 2
    assert "max_calls" in done.stderr


def test_a_second_supervisor_on_a_busy_state_dir_refuses_naming_the_holder(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "st"
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "run",
            "--state-dir",
            str(state),
            "--plan",
            str(plan_file),
            "--",
            sys.executable,
            str(GUEST),
            "wait",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as first:
        try:
            assert first.stdout is not None and first.stdin is not None
            assert read_line(first.stdout).strip() == "ready"
            second = run_guest(state, plan_file, "exit", "0")
            first.stdin.close()
            assert first.wait(timeout=STEP_TIMEOUT_S) == 0
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(timeout=STEP_TIMEOUT_S)
    assert second.returncode == 2
    assert f"pid {first.pid}" in second.stderr
    assert "hostcall serve" in second.stderr


def test_resuming_an_invocation_with_another_plan_is_refused(
    tmp_path: Path, plan_file: Path
) -> None:
    state = tmp_path / "st"
    assert run_guest(state, plan_file, "exit", "0", extra=("--invocation", "inv_1")).returncode == 0
    plan_file.write_text(plan_file.read_text().replace("max_calls = 5", "max_calls = 6"))
    done = run_guest(state, plan_file, "exit", "0", extra=("--invocation", "inv_1"))
    assert done.returncode == 2
    assert "inv_1 runs under plan sha256:" in done.stderr


def test_the_guest_output_passes_through_and_hostcall_variables_are_set(
    tmp_path: Path, plan_file: Path
) -> None:
    done = hostcall(
        "run",
        "--state-dir",
        str(tmp_path / "st"),
        "--plan",
        str(plan_file),
        "--invocation",
        "inv_env",
        "--",
        sys.executable,
        "-c",
        "import os; print(os.environ['HOSTCALL_INVOCATION'], os.environ['HOSTCALL_PLAN'][:7],"
        " os.path.exists(os.environ['HOSTCALL_SOCKET']))",
        env={**os.environ, "HOSTCALL_STATE_DIR": str(tmp_path / "ignored")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["inv_env", "sha256:", "True"]


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "no-sandbox"])
def test_sigterm_to_hostcall_stops_the_guest_tree_and_exits_128_plus_15(
    tmp_path: Path, plan_file: Path, sandbox: bool
) -> None:
    extra = () if sandbox else ("--no-sandbox",)
    with start_tree(tmp_path / "st", plan_file, *extra) as hostcall_process:
        assert hostcall_process.stdout is not None
        watch = TreeWatch(json.loads(read_line(hostcall_process.stdout)), sandboxed=sandbox)
        try:
            assert read_line(hostcall_process.stdout).strip() == "ready"
            hostcall_process.send_signal(signal.SIGTERM)
            assert hostcall_process.wait(timeout=STEP_TIMEOUT_S) == 128 + signal.SIGTERM
            assert watch.alive() == []
        finally:
            watch.close()


def test_attempts_relaunch_until_success_and_report_each_execution(
    tmp_path: Path, plan_file: Path
) -> None:
    # The guest keeps its count in a folder the plan lets it write.
    counter = plan_file.parent.parent / "shared" / "n"
    code = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]);"
        " n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1));"
        " sys.exit(0 if n == 1 else 7)"
    )
    done = hostcall(
        "run",
        "--state-dir",
        str(tmp_path / "st"),
        "--plan",
        str(plan_file),
        "--attempts",
        "3",
        "--json",
        "--",
        sys.executable,
        "-c",
        code,
        str(counter),
    )
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0
    assert [e["exit_code"] for e in summary["executions"]] == [7, 0]
    assert {"cpu_s", "peak_rss_bytes", "duration_s", "reason", "signal"} <= set(
        summary["executions"][0]
    )


def test_a_relaunch_that_cannot_start_keeps_the_attempts_that_ran(
    tmp_path: Path, plan_file: Path
) -> None:
    """The guest deletes its own program and fails: the second attempt cannot
    start. The summary used to say ``"executions": []``, as if nothing had
    run, though the first attempt ran (and may have made calls)."""
    shared = plan_file.parent.parent / "shared"
    shared.mkdir()
    agent = shared / "agent.sh"
    agent.write_text('#!/bin/sh\nrm -f "$0"\nexit 7\n')
    agent.chmod(0o755)
    if os.geteuid() == 0:  # the guests' uid must delete it
        for path in (shared, agent):
            os.chown(path, 65534, 65534)
    done = hostcall(
        "run",
        *("--state-dir", str(tmp_path / "st"), "--plan", str(plan_file)),
        *("--attempts", "2", "--json", "--", str(agent)),
    )
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 7, done.stderr
    assert [e["exit_code"] for e in summary["executions"]] == [7]
    assert summary["error"].startswith("attempt 2 could not start:"), summary
    assert ": attempt 2 could not start: [Errno 2] No such file or directory" in done.stderr


def test_a_memory_limit_is_reported_and_exits_125(tmp_path: Path, plan_file: Path) -> None:
    code = (
        "x = bytearray(400 * 2**20); x[::4096] = b'1' * len(x[::4096]); import time; time.sleep(30)"
    )
    done = hostcall(
        "run",
        "--state-dir",
        str(tmp_path / "st"),
        "--plan",
        str(plan_file),
        "--memory",
        "100",
        "--",
        sys.executable,
        "-c",
        code,
    )
    assert done.returncode == 125
    assert "stopped by its memory limit" in done.stderr


def test_a_second_supervisor_on_one_sqlite_database_is_refused_whatever_its_state_dir(
    tmp_path: Path, plan_file: Path
) -> None:
    """SPEC §6: one supervisor per state dir, and so per SQLite database — but
    ``--store sqlite:///PATH`` can name one file from two state dirs. A second
    supervisor there would turn the first one's in-flight calls ``unknown``
    at its start; it is refused instead, naming the holder."""
    database = tmp_path / "store" / "effects.db"
    store = f"sqlite:///{database}"
    serve = ["serve", "--state-dir", str(tmp_path / "a"), "--plan", str(plan_file)]
    with subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", *serve, "--store", store],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stderr is not None
            assert read_line(server.stderr).startswith("hostcall serve: plan cli")
            second = run_guest(tmp_path / "b", plan_file, "exit", "0", extra=("--store", store))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=STEP_TIMEOUT_S)
    after = run_guest(tmp_path / "b", plan_file, "exit", "0", extra=("--store", store))

    assert second.returncode == 2
    assert f"effect store {database} is in use by another supervisor (pid {server.pid})" in (
        second.stderr
    )
    assert "exited with" not in second.stderr  # no guest was launched
    assert after.returncode == 0  # once the first has stopped


def test_serve_launches_guests_through_the_admin_api_until_sigterm(
    tmp_path: Path, plan_file: Path
) -> None:
    from supervisor.admin_client import AdminClient

    state = tmp_path / "st"
    calls = json.dumps([["c1", "echo", {"text": "served"}]])
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "serve",
            "--state-dir",
            str(state),
            "--plan",
            str(plan_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stderr is not None
            banner = read_line(server.stderr)  # printed once both sockets listen
            assert banner.startswith("hostcall serve: plan cli")
            client = AdminClient(state)
            launched = client.request(
                "POST",
                "/v1/invocations",
                {
                    "argv": [sys.executable, str(GUEST), "calls", calls],
                    "invocation": "inv_srv",
                },
            )
            assert launched["invocation_id"] == "inv_srv"
            assert server.stdout is not None
            # The served guest's output passes through to hostcall serve's own.
            assert json.loads(read_line(server.stdout))["pid"] > 0
            assert json.loads(read_line(server.stdout)) == {"call_id": "c1", "result": "served"}
            records = client.request("GET", "/v1/invocations/inv_srv/calls")
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=STEP_TIMEOUT_S) == 128 + signal.SIGTERM
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=STEP_TIMEOUT_S)
    assert records[0]["status"] == "committed"
    assert not (state / "admin.sock").exists()
