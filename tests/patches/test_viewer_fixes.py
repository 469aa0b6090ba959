"""The viewer-stack fixes (splat_metal_method/patches/viewer.py), on a real viser server and nerfstudio's
real Viewer: a camera message of a client that has just left no longer raises inside viser's atomic(),
and an exception inside atomic() no longer leaves its lock held (which made Ctrl-C hang ns-train)."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import SimpleNamespace

import demo_runs
import numpy as np
import pytest

import splat_metal_method.method.configs  # noqa: F401  (applies the fixes, as ns-train and ns-viewer do)

NO_SCENE = SimpleNamespace(set_background_image=lambda *args, **kwargs: None)  # a client's frames go nowhere


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _stops_within(server, seconds: float) -> bool:
    stopper = threading.Thread(target=server.stop, daemon=True)  # daemon: a hang must not hang pytest
    stopper.start()
    stopper.join(seconds)
    return not stopper.is_alive()


def _in_thread(fn, seconds: float = 10.0) -> bool:
    """Runs ``fn`` on another thread; whether it finished within ``seconds``."""
    worker = threading.Thread(target=fn, daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()


def test_an_exception_inside_viser_atomic_releases_its_lock():
    import viser

    server = viser.ViserServer(port=_free_port(), verbose=False)
    handler = server._websock_server
    try:
        with server.atomic():
            with server.atomic():  # an inner call on the owning thread is ignored, as in viser
                assert handler._atomic_lock.locked()
            assert handler._atomic_lock.locked(), "the inner atomic() released the outer one's lock"
        assert not handler._atomic_lock.locked()

        with pytest.raises(KeyError):
            with server.atomic():
                raise KeyError("client 3")
        assert not handler._atomic_lock.locked(), "atomic() kept its lock after an exception"
        assert handler._locked_thread_id == -1

        def other_thread():
            with server.atomic():
                server.gui.add_markdown("sent from another thread")

        assert _in_thread(other_thread), "another thread could not enter atomic() after the exception"
    finally:
        stopped = _stops_within(server, 20)
    assert stopped, "ViserServer.stop() hung"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return demo_runs.sh3_run(tmp_path_factory)


@contextlib.contextmanager
def _viewer_with_a_client(run, tmp_path, client_id: int):
    """nerfstudio's Viewer on ``run`` with a stand-in client handed to it as viser hands a browser;
    yields (viewer, client, the client's camera callbacks). The server must stop within 20 s after."""
    from nerfstudio.configs.base_config import ViewerConfig
    from nerfstudio.viewer.viewer import Viewer

    pipeline, _, _ = demo_runs.load_pipeline(run)
    viewer = Viewer(ViewerConfig(websocket_port=_free_port()), log_filename=tmp_path / "viewer_log.txt",
                    datapath=run.parent, pipeline=pipeline)  # fmt: skip
    try:
        camera_callbacks = []
        camera = SimpleNamespace(
            wxyz=np.array([1.0, 0.0, 0.0, 0.0]), position=np.array([0.0, 0.0, 3.0]), fov=1.0, aspect=4 / 3,
            on_update=lambda cb: camera_callbacks.append(cb) or cb,
        )  # fmt: skip
        client = SimpleNamespace(client_id=client_id, camera=camera, scene=NO_SCENE)
        viewer.handle_new_client(client)
        yield viewer, client, camera_callbacks
    finally:
        stopped = _stops_within(viewer.viser_server, 20)
    assert stopped, "ViserServer.stop() hung (nerfstudio's shutdown on Ctrl-C)"


def test_a_camera_message_after_its_client_left_does_not_hang_the_viewer(run, tmp_path):
    """The sequence that hung Ctrl-C: nerfstudio's Viewer gets a client, the client disconnects, then
    a camera message of that client is handled (viser runs both on its thread pool, in either order)."""
    with _viewer_with_a_client(run, tmp_path, 7) as (viewer, client, camera_callbacks):
        machine = viewer.render_statemachines[7]
        viewer.handle_disconnect(client)
        machine.join(10)
        assert not machine.is_alive() and 7 not in viewer.render_statemachines
        (on_camera,) = camera_callbacks

        on_camera(client.camera)  # the late camera message: no KeyError
        assert not viewer.viser_server._websock_server._atomic_lock.locked()
        viewer.update_scene(step=1)  # a training step with the gone client: nothing to render for it


def test_the_fixes_keep_nerfstudio_viewer_behaviour_for_connected_clients(run, tmp_path):
    """A connected client still gets its own render state machine and its camera moves reach it."""
    from nerfstudio.viewer.render_state_machine import RenderStateMachine

    with _viewer_with_a_client(run, tmp_path, 3) as (viewer, client, camera_callbacks):
        machine = viewer.render_statemachines[3]
        assert isinstance(machine, RenderStateMachine) and machine.running
        machine.running = False  # keep its thread from rendering: only the hand-over is checked here
        machine.join(10)
        camera_callbacks[0](client.camera)
        assert machine.next_action is not None and machine.next_action.action == "move"
        viewer.handle_disconnect(client)
        assert 3 not in viewer.render_statemachines


def test_a_stopped_viser_server_drops_late_browser_messages():
    """After viser's server stops (the end of a run, Ctrl-C), a still-connected browser's messages are
    dropped; unpatched viser raises 'cannot schedule new futures after shutdown' for each, which
    websockets prints as a traceback under our end-of-run lines."""
    import viser

    from splat_metal_method.patches import viewer as viewer_fixes

    viewer_fixes.apply()
    server = viser.ViserServer(host="127.0.0.1", port=_free_port())
    executor = server._websock_server._thread_executor
    assert executor.submit(lambda: 41 + 1).result(timeout=10) == 42  # running: work is done
    server.stop()
    assert executor.submit(lambda: 1 / 0).result(timeout=10) is None  # stopped: dropped, nothing raised


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
