"""Secrets given on the command line, moved out of it.

Any user of the machine can read a process's command line (ps, /proc/PID/cmdline)
for as long as it runs. A secret given there (a join code holds the fleet token;
an API key) is moved out at once: the process runs itself again without it, handing
the value over through an inherited pipe, so the running node or head never shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.errors import StartError

SECRETS_FD_ENV = "SHOAL_ARGV_SECRETS_FD"
SECRET_OPTIONS = {"code": "--code", "api_key": "--api-key"}  # dest -> option
MAX_HANDED_OVER = 16_384


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without every ``OPTION VALUE`` and ``OPTION=VALUE`` (an abbreviation
    of OPTION too, as argparse takes it); what follows ``--`` is kept."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        name, eq, _ = arg.partition("=")
        if len(name) > 2 and name.startswith("--") and option.startswith(name):
            i += 1 if eq else 2
            continue
        out.append(arg)
        i += 1
    return out


def literal_code(code: str) -> bool:
    """Whether --code was given the join URL itself (not -, @FILE or a path)."""
    return code != "-" and not code.startswith("@") and not Path(code).is_file()


def secrets_in_argv(args: argparse.Namespace) -> dict[str, str]:
    found: dict[str, str] = {}
    code = getattr(args, "code", None)
    if isinstance(code, str) and literal_code(code):
        found["code"] = code
    key = getattr(args, "api_key", None)
    if isinstance(key, str):
        found["api_key"] = key
    return found


def hand_over_and_exec(found: dict[str, str]) -> None:
    """Run this program again without the secrets in its command line; they go through a
    pipe the new program inherits. Returns (after a warning) only where that cannot be
    done; on success it does not return."""
    tail = sys.argv[1:]
    for dest in found:
        tail = without_option(tail, SECRET_OPTIONS[dest])
    orig = list(getattr(sys, "orig_argv", []))
    n = len(sys.argv) - 1
    data = json.dumps(found).encode("utf-8")
    if os.name == "nt" or not orig or (n and orig[-n:] != sys.argv[1:]) \
            or any(arg == v or arg.endswith(f"={v}") for v in found.values() for arg in tail) \
            or len(data) > MAX_HANDED_OVER:
        names = " and ".join(SECRET_OPTIONS[d] for d in found)
        print(f"shoal: other users of this machine can read the value of {names} in its "
              "command line; use --code - or @FILE, --api-key-file or $SHOAL_API_KEY instead",
              file=sys.stderr)
        return
    prefix = orig[:len(orig) - n] if n else orig
    read_end, write_end = os.pipe()
    try:
        view = memoryview(data)
        while view:  # far below a pipe's buffer: this never waits for the reader
            view = view[os.write(write_end, view):]
    finally:
        os.close(write_end)
    os.set_inheritable(read_end, True)
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, SECRETS_FD_ENV: str(read_end)}
    os.execve(sys.executable, [*prefix, *tail], env)  # noqa: S606 - this very program


def take_handed_over() -> dict[str, str]:
    """The secrets the previous image of this process handed over (see above)."""
    fd_text = os.environ.pop(SECRETS_FD_ENV, None)  # not for our children
    if fd_text is None:
        return {}
    try:
        fd = int(fd_text)
        with os.fdopen(fd, "rb") as pipe:
            found = json.loads(pipe.read(MAX_HANDED_OVER + 1))
        if not isinstance(found, dict) or not set(found) <= set(SECRET_OPTIONS) \
                or not all(isinstance(v, str) for v in found.values()):
            raise ValueError
    except (OSError, ValueError):
        raise StartError("the options moved out of the command line at start were lost; "
                         "run the command again") from None
    return found


def read_stdin_code() -> str:
    """``--code -``: the join code from stdin, typed without echo on a terminal."""
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass("shoal: paste the join code (shoal://join?...) and press "
                               "Enter: ", stream=sys.stderr)
    line = sys.stdin.readline(MAX_HANDED_OVER)
    if not line.strip():
        raise StartError("--code - read no join code from stdin; pipe it in, e.g. "
                         "`shoal node join --code - < code.txt`")
    return line


def api_key(args: argparse.Namespace) -> str | None:
    """The static key: --api-key, --api-key-file (private) or $SHOAL_API_KEY."""
    from engine.files import read_secret_file

    path: Path | None = args.api_key_file
    if path is None:
        return args.api_key or os.environ.get("SHOAL_API_KEY") or None
    if args.api_key:
        raise StartError("give the API key with --api-key or --api-key-file, not both")
    data = read_secret_file(path, "the API key file", StartError)
    key = (data or b"").decode("utf-8", errors="replace").strip()
    if data is None or not key:
        raise StartError(f"there is no API key in {path}; write the key there or leave out "
                         "--api-key-file")
    return key
