"""The viewer opens on the scene: a browser that connects looks through the first training camera.

nerfstudio 1.1.5's viewer starts every browser at viser's default camera, wherever that falls in a
scene scaled to fit [-1, 1] (inside it, a dark or blurred view; or the scene off to one side), until
the user finds a training camera to click and hides the cameras. Here each browser, when it connects (ns-train
--vis viewer, ns-viewer), is given the pose of the first training camera exactly as nerfstudio draws
its frustum (position times VISER_NERFSTUDIO_SCALE_RATIO, orientation turned by pi about x from
nerfstudio's OpenGL camera to viser's OpenCV one) and a field of view that shows the whole photo.

Which camera: the first one (index 0 of the training set). nerfstudio's viewer already counts it as
the current camera (``current_camera_idx = 0``, the index a render passes on), its frustum is always
drawn (``max_num_display_images`` picks evenly spaced indices from 0), and it is the capture's first
photo. The camera nearest the cameras' centre is no better a view on an orbit (every camera of a
ring is as near), and would be one more rule to explain.

Field of view: viser's camera has a vertical fov, square pixels and the principal point at the
centre, and the browser's canvas has its own aspect. The fov is the smallest that shows the whole
photo in the canvas (its height where the canvas is wider than the photo, its width where it is
narrower, counting an off-centre principal point), so what the camera photographed is all in view.
It follows the photo, not the frustum's outline: nerfstudio draws frustums with ``fov = 2 atan(cx / fx)``,
the horizontal angle where viser takes the vertical one, so the outline is wider than the photo.

The frustum of that camera is not drawn (set invisible when nerfstudio adds the frustums): a browser
looking through it would see the frustum's own thumbnail of the photo in front of the render (viser
draws it about 0.2 viser units ahead at nerfstudio's camera_frustum_scale 0.1, past its near plane at
0.05). Every other frustum is drawn as nerfstudio draws it, clicking one moves there as before, and
"Hide Train Cams" / "Show Train Cams" hide and show all of them, this one included.

The browser may already have sent a camera message or two of viser's default view before it gets the
new camera (they cross on the websocket): the viewer renders those first (for 0.1 to 1.5 s in the
browser tests, on a loaded 2-core machine), and every render after that is through camera 0.

Installed by the model (``SplatMetalModel.opening_view``): nerfstudio's Viewer hands every
``ViewerControl`` it finds on the pipeline the viewer itself, so this applies to splat-metal's
viewers only, without patching nerfstudio.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Tuple

import numpy as np
from nerfstudio.viewer.viewer_elements import ViewerControl

if TYPE_CHECKING:
    import viser
    from nerfstudio.cameras.cameras import Cameras
    from nerfstudio.viewer.viewer import Viewer

OPENING_CAMERA = 0  # index of the training camera a browser opens on


def viser_pose(camera_to_world: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(wxyz, position) in viser's world of a nerfstudio camera-to-world [3, 4], as nerfstudio's
    ``Viewer.init_scene`` places that camera's frustum."""
    import viser.transforms as vtf
    from nerfstudio.viewer.viewer import VISER_NERFSTUDIO_SCALE_RATIO

    rotation = vtf.SO3.from_matrix(camera_to_world[:3, :3]) @ vtf.SO3.from_x_radians(np.pi)
    return rotation.wxyz, camera_to_world[:3, 3] * VISER_NERFSTUDIO_SCALE_RATIO


def fitting_fov(camera: Cameras, canvas_aspect: float) -> float:
    """Vertical field of view (radians) of a centred camera with ``camera``'s focal lengths that shows
    all of its photo in a canvas of width / height ``canvas_aspect``. ``camera``: one camera, []."""
    fx, fy, cx, cy = (float(v) for v in (camera.fx, camera.fy, camera.cx, camera.cy))
    width, height = float(camera.width), float(camera.height)
    tan_up = max(cy, height - cy) / fy  # the photo's farther edge from the axis, as tan of its angle
    tan_side = max(cx, width - cx) / fx
    return 2 * math.atan(max(tan_up, tan_side / canvas_aspect))


class OpeningView(ViewerControl):
    """Puts each browser that connects to the viewer behind training camera OPENING_CAMERA."""

    def _setup(self, viewer: Viewer) -> None:
        super()._setup(viewer)
        viewer.viser_server.on_client_connect(lambda client: look_through(viewer, client))
        init_scene = viewer.init_scene

        def init_scene_without_the_opening_frustum(*args, **kwargs):
            init_scene(*args, **kwargs)
            frustum = viewer.camera_handles.get(OPENING_CAMERA)
            if frustum is not None:
                frustum.visible = False

        viewer.init_scene = init_scene_without_the_opening_frustum  # type: ignore[method-assign]


def look_through(viewer: Viewer, client: viser.ClientHandle) -> None:
    """viser's connect callback (run after the client's first camera message): the client's camera
    takes the opening camera's pose and a fov that fits its photo in the client's canvas."""
    dataset = getattr(viewer.pipeline.datamanager, "train_dataset", None)
    if dataset is None or len(dataset.cameras) <= OPENING_CAMERA:
        return
    camera = dataset.cameras[OPENING_CAMERA]
    frustum = getattr(viewer, "camera_handles", {}).get(OPENING_CAMERA)
    if frustum is not None:  # where it is drawn now (it follows the camera optimizer)
        wxyz, position = frustum.wxyz, frustum.position
    else:  # not drawn yet: where init_scene will draw it
        wxyz, position = viser_pose(camera.camera_to_worlds.cpu().numpy())
    with client.atomic():
        client.camera.position = position
        client.camera.wxyz = wxyz  # after the position: viser keeps the look-at distance
        client.camera.fov = fitting_fov(camera, client.camera.aspect)
    viewer.current_camera_idx = OPENING_CAMERA
