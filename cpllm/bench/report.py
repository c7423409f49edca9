"""Tables on the terminal (rich) and JSON files."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str] | None = None,
                console: Console | None = None) -> None:
    """One row per dict; columns default to the first row's keys (lists are left out)."""
    if not rows:
        return
    columns = columns or [k for k, v in rows[0].items() if not isinstance(v, (list, dict))]
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if isinstance(rows[0].get(column), str) else "right")
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    # Piped output (CI logs, files) would otherwise be cut to 80 columns.
    (console or Console(width=None if sys.stdout.isatty() else 200)).print(table)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` (with machine info added by the caller) as indented JSON, creating folders."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)
