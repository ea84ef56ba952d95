"""Pictures read as transformers' ``load_image`` reads them: EXIF orientation applied.

A camera often stores a portrait photo as a landscape raster with an EXIF ``Orientation`` tag (5-8:
turned by 90 degrees); transformers' ``load_image`` applies it (``PIL.ImageOps.exif_transpose``),
so the processor sees the turned picture. Packing sizes pictures (`picture_size`) and a training-time
loader opens them (`open_image`), both turned the same way. Both decode every pixel: a file that
decodes only in part (a truncated JPEG with a valid header) fails when packing, not mid-epoch.
"""

from __future__ import annotations

from pathlib import Path


def open_image(path: str | Path):
    """The picture at ``path`` as an RGB ``PIL.Image``, EXIF orientation applied (decoded fully).

    Raises:
        FileNotFoundError, PIL.UnidentifiedImageError, OSError, SyntaxError, ValueError,
        PIL.Image.DecompressionBombError: as PIL opening and decoding the file raise them.
    """
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def picture_size(path: str | Path) -> tuple[int, int]:
    """``(height, width)`` of the picture as loaded (EXIF orientation applied), decoded in full.

    Raises:
        as `open_image`.
    """
    image = open_image(path)
    return image.height, image.width
