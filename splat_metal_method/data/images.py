"""Training images decoded as cameras write them: the one place splat-metal turns an image file into pixels.

nerfstudio 1.1.5's ``InputDataset.get_numpy_image`` does ``np.array(pil_image, dtype="uint8")``. For a
16-bit grayscale PNG (PIL mode "I;16") that keeps the low byte of every pixel: the scene trains on noise,
without a word. 16-bit RGB(A) PNGs and TIFFs PIL reduces to 8 bits itself (it keeps the high byte); a
palette PNG comes out as its palette indices, a grey+alpha PNG as two channels (an assert), a CMYK JPEG as
four channels taken for RGBA.

``read_image`` returns every image as [H, W, 3 or 4] in the depth it was stored with: uint8, or uint16 for a
16-bit image (full precision: 16-bit RGB(A) is decoded with OpenCV, which keeps all 16 bits). 8-bit L, RGB
and RGBA images are decoded and resized exactly as nerfstudio does (same array, bit for bit); grayscale is
repeated to 3 channels and an alpha channel is kept, as nerfstudio does. ``SplatMetalDataset`` serves it to
nerfstudio's datamanager:

  * ``get_numpy_image`` / ``get_image_uint8`` (nerfstudio's uint8 contract, splat-metal's default
    ``cache_images_type="uint8"``): a 16-bit image scaled to 8 bits, round(v / 257);
  * ``get_image_float32`` (``--pipeline.datamanager.cache-images-type float32``): v / 65535, all 16 bits.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt
import torch
from nerfstudio.data.datasets.base_dataset import InputDataset
from PIL import Image
from torch import Tensor

SIXTEEN_BIT_GRAY = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # "I": 32-bit ints, how some readers give 16-bit gray
NERFSTUDIO_MODES = ("L", "RGB", "RGBA")  # decoded exactly as nerfstudio 1.1.5 decodes them


def _rawmode(im: Image.Image) -> str:
    """The pixel layout in the file, e.g. "RGB;16B" for a 16-bit RGB PNG (PIL's mode is then just "RGB")."""
    if not im.tile:
        return im.mode
    args = im.tile[0][3]  # (codec, extents, offset, args); args is the rawmode or a tuple starting with it
    return str(args[0] if isinstance(args, tuple) else args)


def _resize_16(image: npt.NDArray[np.uint16], size) -> npt.NDArray[np.uint16]:
    """nerfstudio's bilinear resize (PIL's filter) for a 16-bit [H, W, C] image, one float channel at a time."""
    channels = [
        np.asarray(Image.fromarray(image[:, :, c].astype(np.float32), mode="F").resize(size, Image.Resampling.BILINEAR))
        for c in range(image.shape[2])
    ]
    return np.clip(np.rint(np.stack(channels, axis=-1)), 0, 65535).astype(np.uint16)


def read_image(path: Path, scale_factor: float = 1.0) -> np.ndarray:
    """The image at ``path`` as [H, W, 3 or 4], uint8 or uint16 as stored, resized by ``scale_factor`` as
    nerfstudio resizes (bilinear, to int(size * scale_factor))."""
    with Image.open(path) as im:
        newsize = (int(im.size[0] * scale_factor), int(im.size[1] * scale_factor))
        if im.mode in NERFSTUDIO_MODES and ";16" not in _rawmode(im):  # nerfstudio's own decode, unchanged
            if scale_factor != 1.0:
                im = im.resize(newsize, resample=Image.Resampling.BILINEAR)
            image = np.array(im, dtype="uint8")  # [H, W] or [H, W, 3 or 4]
        elif im.mode in SIXTEEN_BIT_GRAY:
            image = np.clip(np.asarray(im), 0, 65535).astype(np.uint16)  # [H, W]
        elif im.mode in ("RGB", "RGBA"):  # 16 bits per channel in the file; PIL would keep only the high byte
            image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)  # [H, W, 3 or 4] uint16, BGR(A)
            if image is None or image.dtype != np.uint16 or image.shape[:2] != im.size[::-1]:
                raise ValueError(f"OpenCV could not decode the 16-bit image {path}")
            image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB if image.shape[2] == 3 else cv2.COLOR_BGRA2RGBA)
        else:  # palette, grey+alpha, bilevel, CMYK, YCbCr, ...: to RGB(A) as PIL converts them
            has_alpha = "A" in im.mode or "transparency" in im.info
            image = np.array(im.convert("RGBA" if has_alpha else "RGB"), dtype="uint8")
            if scale_factor != 1.0:
                image = np.array(Image.fromarray(image).resize(newsize, resample=Image.Resampling.BILINEAR))
    if image.ndim == 2:
        image = image[:, :, None].repeat(3, axis=2)  # grayscale: 3 equal channels, as nerfstudio
    if image.dtype == np.uint16 and scale_factor != 1.0:
        image = _resize_16(image, newsize)
    assert image.ndim == 3 and image.shape[2] in (3, 4), f"image {path} decoded to shape {image.shape}"
    return image


def to_uint8(image: np.ndarray) -> npt.NDArray[np.uint8]:
    """uint8 as is; uint16 scaled to 8 bits, round(v / 257) (65535 -> 255)."""
    if image.dtype == np.uint8:
        return image
    return np.rint(image.astype(np.float32) / 257.0).astype(np.uint8)


def to_float32(image: np.ndarray) -> npt.NDArray[np.float32]:
    """In [0, 1]: v / 255 for uint8 (nerfstudio's), v / 65535 for uint16."""
    return image.astype(np.float32) / (65535.0 if image.dtype == np.uint16 else 255.0)


class SplatMetalDataset(InputDataset):
    """nerfstudio's InputDataset with its image decoding replaced by ``read_image`` (module docstring).
    Everything else (masks, mask_color, metadata, alpha_color blending) is nerfstudio's."""

    def get_numpy_image(self, image_idx: int) -> npt.NDArray[np.uint8]:
        """[H, W, 3 or 4] uint8, as nerfstudio's; a 16-bit image scaled to 8 bits."""
        return to_uint8(read_image(self._dataparser_outputs.image_filenames[image_idx], self.scale_factor))

    def get_image_float32(self, image_idx: int) -> Tensor:  # [H, W, 3 or 4]
        """nerfstudio's, with a 16-bit image's full precision (v / 65535)."""
        image = read_image(self._dataparser_outputs.image_filenames[image_idx], self.scale_factor)
        image = torch.from_numpy(to_float32(image))  # [H, W, 3 or 4]
        alpha_color = self._dataparser_outputs.alpha_color
        if alpha_color is not None and image.shape[-1] == 4:  # nerfstudio's blend
            assert (alpha_color >= 0).all() and (alpha_color <= 1).all(), "alpha color given is out of range [0, 1]."
            image = image[:, :, :3] * image[:, :, -1:] + alpha_color * (1.0 - image[:, :, -1:])
        return image
