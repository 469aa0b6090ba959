"""Progress of ``splat-metal-export``'s writes, shown as nerfstudio's commands show theirs (rich, on
nerfstudio's console): one bar per file, with the step it is in (the .sog's k-means, the .ply's
blocks of rows), the elapsed time and, while a step counts, the time remaining.

Encoders take an optional ``report(step, done, total)``; ``Report`` turns those calls into the bar.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

Report = Callable[[str, int, int], None]  # (step, done, total)


@contextlib.contextmanager
def export_progress() -> Iterator[Callable[[str], Report]]:
    """``with export_progress() as bar: report = bar("splat.sog")`` gives each file its bar."""
    from nerfstudio.utils.rich_utils import CONSOLE
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
               TimeElapsedColumn(), TimeRemainingColumn(compact=True)]  # fmt: skip
    with Progress(*columns, console=CONSOLE, transient=True) as progress:

        def bar(name: str) -> Report:
            task = progress.add_task(f"writing {name}", total=None)

            def report(step: str, done: int, total: int) -> None:
                progress.update(task, description=f"writing {name}: {step}", completed=done, total=total)

            return report

        yield bar


def no_report(step: str, done: int, total: int) -> None:
    """What an encoder calls when nobody watches."""


def or_none(report: Optional[Report]) -> Report:
    return report if report is not None else no_report
