"""echo_native: a fast image input pipeline with data echoing.

Pipeline order, one module per stage:
  source   where the bytes come from (ImageFolder, Samples)
  decode   JPEG bytes -> augmented pixels (native kernel, libjpeg-turbo)
  ring     shared-memory ring of batch slots (lock-free hand-off)
  workers  processes/threads that fill slots, keyed so any of them can
  loader   the consumer end: ordered zero-copy batches, supervision, cleanup
  echo     data echoing: echo counts, the shuffle buffer, auto echo factor
  device   where echoes are made (CPU: NumPy + native resampler)
  cuda     the same on a GPU: CuPy, copy stream, events, kernels.cu
  pipeline EchoRing, the feeder that wires all of the above
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
from echo_native.output import BFloat16Array
from echo_native.errors import DecodeError
from echo_native.loader import Batch, Loader, SampleFailureWarning, WorkerError
from echo_native.pipeline import EchoRing
from echo_native.source import FileList, ImageFolder, Samples, TarShards
from echo_native.transforms import CenterCrop, RandomResizedCrop

__version__ = "0.1.0"

__all__ = [
    "BFloat16Array",
    "Batch",
    "CenterCrop",
    "FileList",
    "ImageFolder",
    "Loader",
    "RandomResizedCrop",
    "SampleFailureWarning",
    "Samples",
    "TarShards",
    "WorkerError",
    "DecodeError",
    "EchoRing",
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
