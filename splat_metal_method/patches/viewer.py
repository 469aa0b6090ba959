"""Two fixes for the viewer stack nerfstudio 1.1.5 pins (viser 0.2.7), applied by ``apply()`` when
splat-metal's config is imported (ns-train, ns-viewer and every other ns-* command that loads it).

Together they made Ctrl-C hang ns-train (and ns-viewer) for good after a browser left at the wrong
moment; the checkpoint was saved, but the process never exited:

1. viser 0.2.7's ``atomic()`` releases its lock after the ``yield`` without ``try/finally``, so any
   exception inside ``with server.atomic():`` leaves the lock held forever. From then on every message
   sent from another thread is queued behind a task waiting for that lock in viser's thread pool,
   and ``ViserServer.stop()`` (nerfstudio's shutdown) and the interpreter's exit wait for those tasks:
   a hang. Patched to release in ``finally`` (and to clear the owner before releasing, not after),
   only where the installed viser's ``atomic()`` has no ``finally``.
2. The exception that did it: nerfstudio's camera callback (``Viewer.handle_new_client``) looks up
   ``render_statemachines[client_id]`` inside ``with viser_server.atomic():``, and a camera message
   of a client that has just disconnected is handled after ``handle_disconnect`` removed its entry:
   a KeyError. ``Viewer.render_statemachines`` becomes a dict that answers a client that is gone
   with a stopped stand-in whose ``action()`` does nothing (the client will never be rendered for).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from concurrent.futures import Future
from typing import Any, Callable, Generator

_applied = False


class _GoneClient:
    """The render state machine of a client that disconnected: it takes actions and renders nothing."""

    running = False

    def action(self, action: Any) -> None:
        pass


class RenderMachines(dict):
    """nerfstudio's {client id: RenderStateMachine}; a client that is no longer in it gets _GoneClient."""

    def __missing__(self, client_id: int) -> _GoneClient:
        return _GoneClient()


def _get_machines(viewer) -> RenderMachines:
    return viewer.__dict__["render_statemachines"]


def _set_machines(viewer, machines: dict) -> None:
    """Viewer.__init__'s ``self.render_statemachines = {}`` stores a RenderMachines, before any client connects."""
    if not isinstance(machines, RenderMachines):
        machines = RenderMachines(machines)
    viewer.__dict__["render_statemachines"] = machines


@contextlib.contextmanager
def _atomic(self) -> Generator[None, None, None]:
    """viser's WebsockMessageHandler.atomic (same behaviour: inner calls on the owning thread are
    ignored), releasing the lock whatever the body raises."""
    thread_id = threading.get_ident()
    if thread_id == self._locked_thread_id:
        yield
        return
    self._atomic_lock.acquire()
    self._locked_thread_id = thread_id
    try:
        yield
    finally:
        self._locked_thread_id = -1
        self._atomic_lock.release()


def _viser_atomic_leaks_its_lock(handler_class: type) -> bool:
    original = getattr(handler_class.atomic, "__wrapped__", None)
    if original is None:
        return False
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    return "_atomic_lock" in source and "finally" not in source


def _dropped(*args, **kwargs) -> Future:
    done: Future = Future()
    done.set_result(None)
    return done


def _stop_dropping_late_messages(stop: Callable) -> Callable:
    """viser's server stop shuts its thread pool down, but a browser still connected keeps sending
    (camera moves): each message then ends in websockets' "connection handler failed" traceback
    (RuntimeError: cannot schedule new futures after shutdown), printed below our end-of-run lines
    after Ctrl-C. After the stop, such messages are dropped."""

    def stopped(self) -> None:
        executor = self._thread_executor
        stop(self)
        executor.submit = _dropped

    stopped._drops_late_messages = True  # type: ignore[attr-defined]
    return stopped


def apply() -> None:
    """Installs both fixes (once; a no-op where viser or nerfstudio's viewer is not importable)."""
    global _applied
    if _applied:
        return
    _applied = True
    try:
        from nerfstudio.viewer.viewer import Viewer
        from viser.infra._infra import WebsockMessageHandler, WebsockServer
    except ImportError:
        return
    if _viser_atomic_leaks_its_lock(WebsockMessageHandler):
        WebsockMessageHandler.atomic = _atomic  # type: ignore[method-assign]
    if not getattr(WebsockServer.stop, "_drops_late_messages", False):
        WebsockServer.stop = _stop_dropping_late_messages(WebsockServer.stop)  # type: ignore[method-assign]

    if not isinstance(inspect.getattr_static(Viewer, "render_statemachines", None), property):
        Viewer.render_statemachines = property(_get_machines, _set_machines)  # type: ignore[attr-defined]
