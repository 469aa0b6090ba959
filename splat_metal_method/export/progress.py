"""Progress of ``splat-metal-export``'s writes, shown as nerfstudio's commands show theirs (rich, on
nerfstudio's console): one bar per file, with the step it is in (the .sog's k-means, the .ply's
blocks of rows), the elapsed time and, while a step counts, the time remaining.

The bars appear once the writes have taken SHOW_AFTER seconds (a timer thread starts them, with
each file's step and count so far and its elapsed time counted from its start): an export that is
done before then shows none and never imports rich (a .ply of 100k gaussians is written in ~0.05 s;
importing rich and nerfstudio's console took ~0.025 s of the command's ~0.4 s, measured with
``python -X importtime``).

Encoders take an optional ``report(step, done, total)``; ``Report`` turns those calls into the bar.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, List, Optional

Report = Callable[[str, int, int], None]  # (step, done, total)
SHOW_AFTER = 0.5  # seconds of writing before the bars appear


class _File:
    """One file's bar: what its encoder reported so far, and its task once the bars show."""

    def __init__(self, name: str):
        self.name = name
        self.started = time.monotonic()  # rich's clock (Console.get_time)
        self.description = f"writing {name}"
        self.completed: Optional[int] = None
        self.total: Optional[int] = None
        self.task = None  # rich's task id, once shown


class _Bars:
    def __init__(self, after: float, console=None):
        self.files: List[_File] = []
        self.lock = threading.Lock()
        self.console = console
        self.progress = None  # rich's Progress, once shown
        self.closed = False
        self.timer = threading.Timer(after, self.show)
        self.timer.daemon = True  # never keeps the command alive

    def show(self) -> None:
        """Starts rich's live display with every file so far (the timer thread)."""
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        if self.console is None:
            from nerfstudio.utils.rich_utils import CONSOLE

            self.console = CONSOLE
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(compact=True)]  # fmt: skip
        with self.lock:
            if self.closed:
                return
            progress = Progress(*columns, console=self.console, transient=True)
            for f in self.files:
                self._add(progress, f)
            progress.start()
            self.progress = progress

    @staticmethod
    def _add(progress, f: _File) -> None:
        f.task = progress.add_task(f.description, total=f.total, completed=f.completed or 0)
        task = next(t for t in progress.tasks if t.id == f.task)
        task.start_time = f.started  # elapsed since the file began, not since the bars appeared (same clock)

    def bar(self, name: str) -> Report:
        f = _File(name)
        with self.lock:
            self.files.append(f)
            if self.progress is not None:
                self._add(self.progress, f)

        def report(step: str, done: int, total: int) -> None:
            with self.lock:
                f.description, f.completed, f.total = f"writing {name}: {step}", done, total
                if self.progress is not None:
                    self.progress.update(f.task, description=f.description, completed=done, total=total)

        return report

    def close(self) -> None:
        self.timer.cancel()
        if self.timer.is_alive():
            self.timer.join()  # a display being started: let it finish, then stop it
        with self.lock:
            self.closed = True
            progress = self.progress
        if progress is not None:
            progress.stop()


@contextlib.contextmanager
def export_progress(after: float = SHOW_AFTER, console=None) -> Iterator[Callable[[str], Report]]:
    """``with export_progress() as bar: report = bar("splat.sog")`` gives each file its bar; they
    show after ``after`` seconds (on ``console``, default nerfstudio's), and are gone at the end."""
    bars = _Bars(after, console)
    bars.timer.start()
    try:
        yield bars.bar
    finally:
        bars.close()


def no_report(step: str, done: int, total: int) -> None:
    """What an encoder calls when nobody watches."""


def or_none(report: Optional[Report]) -> Report:
    return report if report is not None else no_report
