"""`python -m engine.cli`: the engine's CLI without the app's launcher (tests, benchmarks)."""

import sys

from engine.cli import main

sys.exit(main())
