"""What ``reshard run`` shows while it works, on stderr.

On a terminal: a live display (rich, which comes with Prefect) — what is happening before the
first byte moves (starting Prefect's embedded server, reading the source), then bytes done of
the total, rate and ETA overall and per output file being written. It is erased when the run
ends, so only reshard's summary (stdout) or its one error line (stderr) stays.

When stderr is not a terminal (CI logs, pipes): one plain line per finished output, counted
against every output of the plan (TP x PP of them), and nothing else — a failing run's stderr
is exactly its error line.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO

import reshard.progress as progress


def fmt_bytes(n: float) -> str:
    """``1.5 MiB``: binary units, one decimal (bytes as a whole number)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class ProgressDisplay:
    """Subscribes to :mod:`reshard.progress` for the duration of a ``with`` block."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, status: str = "starting") -> None:
        self.stream = stream or sys.stderr
        self.live = _is_terminal(self.stream) if live is None else live
        self.targets: list[dict[str, Any]] = []
        self.done: dict[str, int] = {}
        self._status = status
        self._rich: Any = None
        self._overall: Any = None
        self._rows: dict[str, Any] = {}
        self._written: dict[str, int] = {}  # bytes produced per output (live display)
        self._unsubscribe = lambda: None

    # -- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> ProgressDisplay:
        if self.live:
            self._start_live()
        self._unsubscribe = progress.subscribe(self.handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._unsubscribe()
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def status(self, text: str) -> None:
        """What happens before the plan exists (shown on a terminal only)."""
        self._status = text
        if self._rich is not None and not self.targets:
            self._rich.update(self._overall, description=text)

    # -- events ----------------------------------------------------------------------------------
    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == progress.PLANNED:
            self.targets = list(event["targets"])
            if self._rich is not None:
                self._planned_live()
        elif kind == progress.BYTES:
            if self._rich is not None and event["name"] in self._rows:
                self._bytes_live(event["name"], event["done"])
        elif kind == progress.STATUS:
            self.status(event["text"])
        elif kind == progress.TARGET_DONE:
            self.done[event["name"]] = event["size"]
            if self._rich is not None:
                self._finished_live(event)
            else:
                self._line(event)

    def _line(self, rec: dict[str, Any]) -> None:
        total = max(len(self.targets), len(self.done))
        bar = "#" * len(self.done) + "." * (total - len(self.done))
        print(f"[{bar}] {len(self.done)}/{total} {rec['name']} <- source ranks {list(rec['sources'])}  "
              f"{fmt_bytes(rec['size'])} in {rec['seconds']:.2f}s", file=self.stream, flush=True)

    # -- the live display --------------------------------------------------------------------------
    def _start_live(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeRemainingColumn

        # bytes and rate in fmt_bytes's binary units, as the summaries and `plan` print them (rich's own
        # columns count in decimal megabytes)
        self._rich = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), *_byte_columns(),
                              TimeRemainingColumn(), console=Console(file=self.stream), transient=True)
        self._overall = self._rich.add_task(self._status, total=None)
        self._rich.start()

    def _planned_live(self) -> None:
        total = sum(t["bytes"] for t in self.targets)
        self._rich.update(self._overall, total=total, completed=0, description=self._overall_text())
        for t in self.targets:
            self._rows[t["name"]] = self._rich.add_task(f"  {t['name']}", total=t["bytes"], visible=False)

    def _bytes_live(self, name: str, done: int) -> None:
        self._written[name] = done
        self._rich.update(self._rows[name], completed=done, visible=True)
        self._refresh_overall()

    def _finished_live(self, rec: dict[str, Any]) -> None:
        row = self._rows.get(rec["name"])
        self._written[rec["name"]] = rec["size"]
        if row is not None:
            self._rich.update(row, total=rec["size"], completed=rec["size"], visible=False)
        self._refresh_overall()

    def _refresh_overall(self) -> None:
        self._rich.update(self._overall, completed=sum(self._written.values()), description=self._overall_text())

    def _overall_text(self) -> str:
        return f"{len(self.done)}/{len(self.targets)} outputs"


def _byte_columns() -> tuple[Any, Any]:
    """The live display's bytes done of the total and its rate, written by :func:`fmt_bytes` (rich's
    own columns count in decimal megabytes, the summaries in MiB); nothing while the total is
    unknown (before the plan), instead of ``0/? bytes``."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Done(ProgressColumn):
        def render(self, task: Any) -> Text:
            if task.total is None:
                return Text("")
            return Text(f"{fmt_bytes(task.completed)} / {fmt_bytes(task.total)}", style="progress.download")

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{fmt_bytes(speed)}/s", style="progress.data.speed")

    return Done(), Rate()


def _is_terminal(stream: TextIO) -> bool:
    import os

    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
