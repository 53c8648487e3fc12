"""The operator's terminal and a guest: escapes shown as text, no terminal for the guest.

A real ``hostcall run`` on a real pseudo-terminal, as an operator runs it.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

from supervisor.terminal import TerminalText, escape_controls
from tests.harness import STEP_TIMEOUT_S

PLAN = '[plan]\nname = "tty"\n'

GUEST = r"""
import os, sys
print("stdin is a terminal:", os.isatty(0), flush=True)
print("typed:", sys.stdin.readline().strip(), flush=True)
sys.stdout.write("\x1b]0;owned\x07\x1b[2Jfake prompt\r\n")
sys.stdout.flush()
"""


def test_control_characters_are_shown_as_text_and_newlines_kept() -> None:
    assert escape_controls(b"a\x1b[2Jb\n\tc\r\n\x07\xc2\x9bd\xc3\xa9") == (
        b"a\\x1b[2Jb\n\tc\r\n\\x07\\xc2\\x9bd\xc3\xa9"
    )


def _read_until(fd: int, needle: bytes, seen: bytearray) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {bytes(seen)!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the terminal's other end has closed
                break
            if not chunk:
                break
            seen += chunk


def test_a_sandboxed_guest_gets_a_pipe_for_stdin_and_its_escapes_reach_the_terminal_as_text(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text(PLAN)
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "supervisor.cli",
                "run",
                "--state-dir",
                str(tmp_path / "state"),
                "--plan",
                str(tmp_path / "plan.toml"),
                "--",
                sys.executable,
                "-c",
                GUEST,
            ],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        seen = bytearray()
        _read_until(master, b"stdin is a terminal: False", seen)
        os.write(master, b"hello\n")  # what the operator types reaches the guest
        _read_until(master, b" exited with ", seen)  # the summary
        assert process.wait(STEP_TIMEOUT_S) == 0
    finally:
        os.close(master)
    text = bytes(seen)
    assert b"typed: hello" in text
    assert b"\\x1b]0;owned\\x07\\x1b[2Jfake prompt" in text
    assert b"\x1b]0;owned" not in text and b"\x1b[2J" not in text


#: A tool whose handler raises: hostcall logs a WARNING line for it.
BOOM_PLAN = '[plan]\nname = "tty"\n\n[tools.boom]\nhandler = "boom_tools:boom"\n'
BOOM_TOOLS = "def boom() -> dict:\n    raise RuntimeError('boom')\n"
#: Leaves a line unfinished (a bare carriage return), waits until the test has
#: seen it on the terminal, then makes hostcall log a line.
BOOM_GUEST = r"""
import os, sys
from guest_client import connect
os.write(2, b"hostcall: call c1 approved by operator, then \r")
sys.stdin.readline()
with connect() as client:
    try:
        client.call("boom", {}, call_id="c1")
    except Exception as exc:
        print("the call:", type(exc).__name__, flush=True)
"""


def test_a_log_line_of_hostcalls_never_shares_a_row_with_a_guests_unfinished_line(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text(BOOM_PLAN)
    (tmp_path / "boom_tools.py").write_text(BOOM_TOOLS)
    master, slave = pty.openpty()
    modes = termios.tcgetattr(slave)
    modes[3] &= ~termios.ECHO  # what the test types would end the guest's row
    termios.tcsetattr(slave, termios.TCSANOW, modes)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run",
             "--state-dir", str(tmp_path / "state"), "--plan", str(tmp_path / "plan.toml"),
             "--", sys.executable, "-c", BOOM_GUEST],
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        )  # fmt: skip
        os.close(slave)
        seen = bytearray()
        _read_until(master, b"approved by operator, then \r", seen)
        os.write(master, b"go\n")
        _read_until(master, b" exited with ", seen)
        assert process.wait(STEP_TIMEOUT_S) == 0
    finally:
        os.close(master)
    rows = bytes(seen).split(b"\n")
    [warning] = [row for row in rows if b"WARNING" in row]
    assert b"boom" in warning and b"approved by operator" not in warning, rows


def test_bytes_that_are_not_utf8_are_shown_as_text_and_split_characters_kept_whole() -> None:
    # A lone 0x9b is CSI to a terminal in an 8-bit mode; a lone 0xff is no text.
    assert escape_controls(b"a\x9b2Jb\xffc\xed\xa0\x80") == b"a\\x9b2Jb\\xffc\\xed\\xa0\\x80"
    text = TerminalText()
    shown = [text.feed(b"x\xc2"), text.feed(b"\x9b2J caf\xc3"), text.feed(b"\xa9 \xf0\x9f\x98")]
    assert text.mid_character
    shown.append(text.feed(b"\x80!"))
    assert shown == [b"x", b"\\xc2\\x9b2J caf", b"\xc3\xa9 ", b"\xf0\x9f\x98\x80!"]
    assert not text.mid_character


def _run_on_a_terminal(tmp_path: Path, guest: str) -> bytes:
    """Everything ``hostcall run`` of ``guest`` shows on a pseudo-terminal."""
    (tmp_path / "plan.toml").write_text(PLAN)
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run",
             "--state-dir", str(tmp_path / "state"), "--plan", str(tmp_path / "plan.toml"),
             "--", sys.executable, "-c", guest],
            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True,
        )  # fmt: skip
        os.close(slave)
        seen = bytearray()
        _read_until(master, b" exited with ", seen)
        assert process.wait(STEP_TIMEOUT_S) == 0
    finally:
        os.close(master)
    return bytes(seen)


def test_a_control_written_in_two_pieces_reaches_the_terminal_as_text(tmp_path: Path) -> None:
    # The guest writes the two bytes of a C1 CSI (U+009B) apart, so that
    # hostcall reads them as two chunks, then a lone 8-bit CSI.
    guest = (
        "import os, time; os.write(1, b'one \\xc2'); time.sleep(0.5); "
        "os.write(1, b'\\x9b2J two \\x9b31m three\\n')"
    )
    text = _run_on_a_terminal(tmp_path, guest)
    assert b"one \\xc2\\x9b2J two \\x9b31m three" in text
    assert b"\x9b" not in text


def test_a_guest_line_left_unfinished_never_shares_a_row_with_hostcalls(tmp_path: Path) -> None:
    # A bare carriage return puts the cursor back at the start of the row:
    # hostcall's next line would be drawn over the guest's text, or after it.
    guest = "import os; os.write(2, b'hostcall: call c1 approved by operator, then ' + b'\\r')"
    text = _run_on_a_terminal(tmp_path, guest)
    [summary] = [row for row in text.split(b"\n") if b" exited with " in row]
    assert b"approved by operator" not in summary
    assert b"approved by operator, then \r\r\n" in text  # the guest's row, ended
