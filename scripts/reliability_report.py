"""Print the table of docs/reliability.md from the rows the drills and hostile tests filed.

    pytest -m drills tests/drills
    pytest tests/unit/test_link_hostile.py tests/integration/test_hostile_link.py \
        tests/integration/test_hostile_http.py
    python scripts/reliability_report.py [test-artifacts/drills.json]

Each test files its row in ``test-artifacts/drills.json`` (``$SHOAL_ARTIFACTS`` moves
the folder); this only renders them, drills first, then hostile cases, each by id.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cell(value: object) -> str:
    if value is None:
        return "n/a"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(rows: dict[str, dict[str, object]]) -> str:
    lines = ["| case | kind | what was tried | times | what happened | tokens lost "
             "| failed with a clear error |", "|---|---|---|---|---|---|---|"]
    order = sorted(rows.values(), key=lambda r: (r["kind"] != "drill", str(r["case"])))
    for r in order:
        lines.append("| " + " | ".join(_cell(r.get(k)) for k in (
            "case", "kind", "tried", "times", "outcome", "tokens_lost", "failed_clear"))
            + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    folder = Path(os.environ.get("SHOAL_ARTIFACTS", ROOT / "test-artifacts"))
    path = Path(argv[1]) if len(argv) > 1 else folder / "drills.json"
    try:
        rows = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"{path} does not exist: run the drills and hostile tests first "
              "(see this script's docstring)", file=sys.stderr)
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
