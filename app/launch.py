"""The `shoal` program: the desktop app for `shoal app` (and for a bundle started with no
arguments, as a double-click starts it), the engine's command line for everything else.

Qt is imported only for the app, so a headless machine runs `shoal serve` without it.
"""

from __future__ import annotations

import sys


def main() -> int:
    argv = sys.argv[1:]
    bundled = getattr(sys, "frozen", False)
    if (argv and argv[0] == "app") or (bundled and not argv):
        from app.main import run

        return run(argv[1:] if argv else [])
    from engine.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
