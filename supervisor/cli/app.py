"""``hostcall``'s entry point: parse, set up logging, run one command, map every
failure to one line on stderr and an exit code (docs/operations.md, "Exit codes").

Only the grammar is imported up front; each command imports what it needs
when it runs, so ``hostcall --help`` and ``hostcall approvals list`` start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from supervisor.cli.parser import build_parser

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_USAGE",
    "inert_json",
    "main",
    "one_line",
    "short_json",
    "state_dir_of",
]

#: An operation was refused: not waiting, not found, a broken chain, not live.
EXIT_FAILED: Final = 1
#: hostcall cannot do what was asked: bad arguments, plan, store or state dir,
#: no supervisor running, no sandbox on this host, an address in use.
EXIT_USAGE: Final = 2
#: A bug in hostcall (one line; ``-vv`` shows the traceback).
EXIT_INTERNAL: Final = 70
#: The shell's "found but cannot be executed" …
EXIT_NOT_EXECUTABLE: Final = 126
#: … and "command not found".
EXIT_NOT_FOUND: Final = 127

#: Each command and the module:function that runs it (imported when it runs).
_COMMANDS: Final = {
    "run": "supervisor.cli.running:run",
    "serve": "supervisor.cli.running:serve",
    "console": "supervisor.cli.running:console",
    "demo": "supervisor.cli.running:demo",
    "launch": "supervisor.cli.commands:launch",
    "invocations": "supervisor.cli.commands:invocations",
    "calls": "supervisor.cli.commands:calls",
    "logs": "supervisor.cli.commands:logs",
    "cancel": "supervisor.cli.commands:cancel",
    "revoke": "supervisor.cli.commands:revoke",
    "approvals": "supervisor.cli.commands:approvals",
    "receipts": "supervisor.cli.commands:receipts",
    "gc": "supervisor.cli.commands:gc",
    "completion": "supervisor.cli.commands:completion",
}


def state_dir_of(args: argparse.Namespace) -> Path:
    """``--state-dir``, given anywhere on the line, else the default (docs/operations.md)."""
    from supervisor.statedir import chosen_state_dir

    return chosen_state_dir(getattr(args, "state_dir", None))


#: Control characters (C0 but tab, DEL, C1): a message may quote what a guest
#: sent (an error naming its argument), and on the operator's terminal an
#: escape sequence would act, a newline would forge a line of our own.
_CONTROLS: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
#: Any character but printable ASCII, tab and newline: looked at by :func:`_unseen`.
_NOT_PLAIN: Final = re.compile(r"[^\x20-\x7e\t\n]")
#: What a guest's text may hide in besides controls: formats (a right-to-left
#: override shows the text after it reversed; zero-width characters; tag
#: characters, text a model reads and a person does not), surrogates, line
#: and paragraph separators …
_UNSEEN: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
#: … and Unicode's Default_Ignorable_Code_Point, which no font draws whatever
#: its category: Hangul fillers, variation selectors (another way to smuggle
#: text), Mongolian selectors, and the ones not yet assigned (which this
#: Python's Unicode tables may not know). From DerivedCoreProperties.txt.
_IGNORABLE: Final = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
    "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)


def one_line(text: str) -> str:
    """``text`` with every control character shown as ``\\xNN``, and every
    other character that is invisible or reorders the text as ``\\uXXXX``:
    one inert line."""
    text = _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return _NOT_PLAIN.sub(lambda m: _unseen(m.group(), _python_escape), text)


def inert_json(
    value: object,
    *,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``value`` as ``json.dumps`` writes it, for an operator deciding on it:
    every character that is invisible, acts on a terminal or reorders the
    text around it is a ``\\uXXXX`` escape (the same JSON value); every other
    character is itself, not escaped as ``ensure_ascii`` would."""
    text = json.dumps(
        value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=False
    )
    return _NOT_PLAIN.sub(lambda m: _unseen(m.group(), _json_escape), text)


def short_json(value: object, width: int) -> str:
    """:func:`inert_json` on one line, keys sorted, cut to ``width`` characters."""
    text = inert_json(value, separators=(",", ":"), sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def _unseen(char: str, escape: Callable[[int], str]) -> str:
    if unicodedata.category(char) in _UNSEEN or _IGNORABLE.match(char):
        return escape(ord(char))
    return char


def _python_escape(code: int) -> str:
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _json_escape(code: int) -> str:
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON writes one
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


class _OneLine(logging.Formatter):
    """``hostcall: LEVEL: message``, the message one inert line; a traceback
    only at debug level."""

    def __init__(self, tracebacks: bool) -> None:
        super().__init__("hostcall: %(levelname)s: %(message)s")
        self._tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        saved = record.msg, record.args, record.exc_info, record.exc_text
        record.msg, record.args = one_line(record.getMessage()), None
        if not self._tracebacks:
            record.exc_info, record.exc_text = None, None
        try:
            line = super().format(record)
        finally:
            record.msg, record.args, record.exc_info, record.exc_text = saved
        where = getattr(record, "hostcall_host_log", None)
        if where and saved[2] and not self._tracebacks:
            return f"{line} (traceback in {where})"
        return line


def _log_level(args: argparse.Namespace) -> int:
    named = getattr(args, "log_level", None)
    if named is not None:
        return int(getattr(logging, named.upper()))
    verbose = getattr(args, "verbose", 0) or 0
    return logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING


class _OwnRows(logging.StreamHandler):  # type: ignore[type-arg]
    """hostcall's log lines, each on a row of its own, also after a guest's
    unfinished line on the same terminal (``Passthrough.own_line``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from supervisor.logs import Passthrough

            Passthrough.own_line(self.stream, self.format(record))
        except Exception:
            self.handleError(record)


def _setup_logging(level: int) -> None:
    handler = _OwnRows(sys.stderr)
    handler.setFormatter(_OneLine(tracebacks=level <= logging.DEBUG))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def _foreign_supervisor() -> str | None:
    """Why this ``supervisor`` package is not (only) hostcall's, if it is not."""
    import supervisor
    from supervisor._foreign import FOREIGN_MESSAGE, is_foreign

    return FOREIGN_MESSAGE if is_foreign(supervisor) else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hostcall")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hostcall`` command."""
    foreign = _foreign_supervisor()
    if foreign is not None:
        print(f"hostcall: {foreign}", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (argcomplete)
        import argcomplete

        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    if args.version:
        print(f"hostcall {_version()}")
        return 0
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("hostcall: give a command; `hostcall --help` lists them", file=sys.stderr)
        return EXIT_USAGE
    level = _log_level(args)
    _setup_logging(level)
    module, _, name = _COMMANDS[args.command].partition(":")
    command: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
    where = f"hostcall {args.command}"
    from supervisor.errors import HostcallError

    try:
        return command(args)
    except HostcallError as exc:
        print(f"{where}: {one_line(exc.message)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `hostcall … | head`: the reader left; say nothing more.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the exit-time flush
        return EXIT_FAILED
    except Exception as exc:  # boundary: one line, never a traceback (but with -vv)
        logging.getLogger("supervisor.cli").debug("internal error", exc_info=True)
        print(
            f"{where}: internal error: {type(exc).__name__}: {one_line(str(exc))} "
            "(run again with -vv for the traceback, and please report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
