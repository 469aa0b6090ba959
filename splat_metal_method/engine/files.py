"""File writes that survive a crash or a signal, without torch or nerfstudio (``splat-metal-export`` imports
this on its fast path; engine/reliability.py re-exports it for the trainer)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator, List, Optional


@contextlib.contextmanager
def atomic_path(target: Path, staging_dir: Optional[Path] = None) -> Iterator[Path]:
    """Yields a temporary path; when the block succeeds, the file written there replaces ``target``
    in one rename (``os.replace``). On any exception (KeyboardInterrupt included) the temporary file
    is removed and ``target`` is untouched. ``staging_dir`` (default: target's folder) must be on the
    same filesystem; the temporary name is hidden: ``.NAME.partial-PID``."""
    target = Path(target)
    tmp = Path(staging_dir or target.parent) / f".{target.name}.partial-{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb+") as f:  # on disk before the rename: a crash cannot leave an empty target
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (a closed terminal, ``kill``) raise KeyboardInterrupt in the block, as Ctrl-C
    does, so that the same clean-up runs (atomic_path removes its temporary file). Main thread only;
    elsewhere (signals cannot be caught there) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS if s != signal.SIGINT}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


PARTIAL_NAME = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>\d+)")
MOVED_ASIDE_NAME = re.compile(r"\.(?P<name>.+)\.old-(?P<pid>\d+)")  # atomic_folder's earlier target


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


PARTIAL_FOLDER_MARK = ".splat-metal-partial"  # the file that says a partial folder is atomic_folder's


@contextlib.contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Yields a hidden temporary folder beside ``target`` (``.NAME.partial-PID``, atomic_path's name,
    holding the mark file PARTIAL_FOLDER_MARK, so that remove_stale_partials knows it for ours); when
    the block succeeds it takes ``target``'s place (an earlier folder or file there is moved aside
    first and removed after) and loses the mark; on any exception it is removed and ``target`` is
    untouched."""
    target = Path(target)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / PARTIAL_FOLDER_MARK).write_bytes(b"")
    try:
        yield tmp
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        (target / PARTIAL_FOLDER_MARK).unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        elif old.exists():  # a file of that name was there before
            old.unlink()


def remove_stale_partials(folder: Path) -> List[Path]:
    """Removes what a SIGKILLed or crashed writer left in ``folder``: the hidden ``.NAME.partial-PID``
    files (atomic_path's) and folders (atomic_folder's: only one holding its mark file, never another
    folder of a matching name) whose process is gone. A live process's are left alone. Returns the
    removed paths."""
    removed = []
    for p in Path(folder).iterdir() if Path(folder).is_dir() else []:
        m = PARTIAL_NAME.fullmatch(p.name)
        if not m or int(m.group("pid")) == os.getpid() or _alive(int(m.group("pid"))):
            continue
        if p.is_file() and not p.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
        elif p.is_dir() and not p.is_symlink() and (p / PARTIAL_FOLDER_MARK).is_file():
            shutil.rmtree(p)
            removed.append(p)
    restore_moved_aside(folder)
    return removed


def restore_moved_aside(folder: Path) -> List[Path]:
    """Puts back what atomic_folder moved aside (``.NAME.old-PID``) when its writer died before the new
    folder took NAME's place: NAME is missing and that process is gone. Nothing is deleted (with NAME
    present, the hidden copy is left for the user). Returns the restored paths."""
    restored = []
    for p in Path(folder).iterdir() if Path(folder).is_dir() else []:
        m = MOVED_ASIDE_NAME.fullmatch(p.name)
        if not m or p.is_symlink() or int(m.group("pid")) == os.getpid() or _alive(int(m.group("pid"))):
            continue
        target = p.parent / m.group("name")
        if not target.exists() and not target.is_symlink():
            os.replace(p, target)
            restored.append(target)
    return restored
