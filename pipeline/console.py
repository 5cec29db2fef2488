"""Terminal output shared by the stages: logging setup and summary tables (rich)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

console = Console(stderr=True)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level, format="%(message)s", datefmt="[%X]", handlers=[RichHandler(console=console, show_path=False)]
    )


def counts_table(title: str, rows: Mapping[str, Mapping[str, Any]]) -> Table:
    """One row per source/split, one column per counter (missing counters shown as 0)."""
    columns: list[str] = []
    for counts in rows.values():
        for key in counts:
            if key not in columns:
                columns.append(key)
    table = Table(title=title)
    table.add_column("")
    for col in columns:
        table.add_column(col, justify="right")
    for name, counts in rows.items():
        table.add_row(name, *[str(counts.get(col, 0)) for col in columns])
    return table
