"""The bundle's entry point: the `shoal` program exactly as the console script runs it (the
app for `shoal app` or no arguments, the engine's CLI for every other command)."""

import sys

from app.launch import main

sys.exit(main())
