"""Pictures read as transformers' ``load_image`` reads them: EXIF orientation applied.

A camera often stores a portrait photo as a landscape raster with an EXIF ``Orientation`` tag (5-8:
turned by 90 degrees); transformers' ``load_image`` applies it (``PIL.ImageOps.exif_transpose``),
so the processor sees the turned picture. Packing sizes pictures from their headers (`picture_size`,
no pixels decoded) and a training-time loader opens them (`open_image`), both turned the same way.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["open_image", "picture_size"]

_ORIENTATION = 0x0112  # the EXIF tag
_TURNED = (5, 6, 7, 8)  # orientations that swap width and height


def picture_size(path: str | Path) -> tuple[int, int]:
    """``(height, width)`` of the picture as loaded (EXIF orientation applied), from its header.

    Raises:
        FileNotFoundError, PIL.UnidentifiedImageError, OSError: as ``PIL.Image.open``.
    """
    from PIL import Image

    with Image.open(path) as image:  # lazy: reads the header, not the pixels
        width, height = image.size
        orientation = image.getexif().get(_ORIENTATION)
    return (width, height) if orientation in _TURNED else (height, width)


def open_image(path: str | Path):
    """The picture at ``path`` as an RGB ``PIL.Image``, EXIF orientation applied (decoded fully)."""
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        turned = ImageOps.exif_transpose(image)
        return turned.convert("RGB")
