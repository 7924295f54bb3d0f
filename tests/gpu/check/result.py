"""A part's JSON result ({"status", "columns", "rows", "notes"}), written atomically after every row, so a part
killed at its time limit still leaves the rows it finished."""

from __future__ import annotations

import json
import time
import traceback

from mpzero.files import write_atomically


class Result:
    def __init__(self, path: str, columns: list[str]):
        self.path, self.data, self.start = path, {"status": "incomplete", "columns": columns, "rows": [],
                                                  "notes": []}, time.monotonic()

    def row(self, **row) -> None:
        self.data["rows"].append(row)
        self.flush()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.flush()

    def finish(self, status: str) -> None:
        self.data["status"] = status
        self.flush()

    def flush(self) -> None:
        write_atomically(self.path, json.dumps(self.data, indent=1, default=str) + "\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def error_text(error: BaseException) -> str:
    """One line for the report (the full traceback goes to the part's log)."""
    traceback.print_exc()
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"
