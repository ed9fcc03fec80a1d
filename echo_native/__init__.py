"""echo_native: a fast image input pipeline with data echoing.

Pipeline order, one module per stage:
  decode   JPEG bytes -> augmented pixels (native kernel, libjpeg-turbo)
"""
from echo_native.decode import (
    center_crop_box,
    decode,
    decode_canvas,
    decode_center_crop,
    decode_crop,
    decode_random_crop,
    image_size,
    pick_scale,
    random_resized_crop_params,
    resize_crop,
)
from echo_native.errors import DecodeError

__version__ = "0.1.0"

__all__ = [
    "DecodeError",
    "__version__",
    "center_crop_box",
    "decode",
    "decode_canvas",
    "decode_center_crop",
    "decode_crop",
    "decode_random_crop",
    "image_size",
    "pick_scale",
    "random_resized_crop_params",
    "resize_crop",
]
