"""What `manage.py trigger --wait` shows while a run goes on, and once it has ended.

On a terminal, a progress bar drawn by `rich` (rows read against the source's estimate,
the rate and the time left, all from the attempt's row in database time); elsewhere (a
pipe, a log file, CI), a plain line when something new is known (a status, the first
total, the first rate) and otherwise at most every `every` seconds while the rows move.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from dispatch.api import RunResult
from dispatch.core.progress import describe, rate_text, seconds_text


def summary_lines(result: RunResult) -> list[str]:
    """The run's end: status, duration, attempts and reason; the error's first line; the
    rows read and written."""
    attempts = f"{result.attempts} attempt{'s' if result.attempts != 1 else ''}"
    head = (
        f"Run {result.run_id} {result.status} in {seconds_text(result.duration_seconds)} "
        f"({attempts})"
    )
    if result.reason:
        head += f", reason {result.reason}"
    lines = [head + "."]
    if result.error_line:
        lines.append(f"Error: {result.error_line}")
    p = result.progress
    rows = f"Rows: {p.rows_read:,} read, {p.rows_written:,} written"
    if p.rows_estimated is not None and not p.succeeded:
        rows += f" (about {p.rows_estimated:,} expected)"
    if p.rate is not None:
        rows += f", {rate_text(p.rate)}"
    lines.append(rows + ".")
    return lines


class WaitDisplay:
    """The waiting run's progress on `stream` (see the module's docstring)."""

    def __init__(self, stream: TextIO, *, tty: bool, every: float = 10.0) -> None:
        self.stream = stream
        self.tty = tty
        self.every = every
        self._last_line = ""
        self._last_known: tuple[str, bool, bool] = ("", False, False)
        self._last_at = 0.0
        self._bar: Any = None
        self._task: Any = None

    def update(self, result: RunResult) -> None:
        if self.tty:
            self._draw(result)
        else:
            self._line(result)

    def note(self, text: str) -> None:
        """A message of its own line (above the bar on a terminal)."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _line(self, result: RunResult) -> None:
        p = result.progress
        line = f"Run {result.run_id} {result.status}"
        if p.started:
            line += f": {describe(p)}"
        # What is known: a line at once when it grows (a new status, the first total,
        # the first rate), otherwise at most every `every` seconds while the rows move.
        known = (result.status, p.total is not None, p.rate is not None)
        now = time.monotonic()
        due = line != self._last_line and now - self._last_at >= self.every
        if known != self._last_known or due:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_line, self._last_known, self._last_at = line, known, now

    def _draw(self, result: RunResult) -> None:
        if self._bar is None:
            # Imported here: only a terminal draws, and importing rich costs time.
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                TextColumn("{task.fields[count]}", markup=False),
                TextColumn("{task.fields[rate]}", markup=False),
                TextColumn("{task.fields[eta]}", markup=False),
                console=Console(file=self.stream, force_terminal=True),
                transient=True,
            )
            self._task = self._bar.add_task(
                f"Run {str(result.run_id)[:8]}", total=None, count="", rate="", eta=""
            )
            self._bar.start()
        p = result.progress
        total = p.total
        if total is None or p.succeeded:
            count = f"{p.rows_read:,} rows"
        else:
            count = f"{p.rows_read:,} / ~{total:,} rows ({100 * (p.fraction or 0):.0f} %)"
        self._bar.update(
            self._task,
            description=f"Run {str(result.run_id)[:8]} {result.status}",
            total=total if total else None,
            completed=p.rows_read,
            count=count if p.started else "",
            rate=rate_text(p.rate),
            eta=f"about {seconds_text(p.eta_seconds)} left" if p.eta_seconds is not None else "",
        )
