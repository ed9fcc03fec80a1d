"""echo_native: a fast image input pipeline with data echoing.

Pipeline order, one module per stage (open them in this order to follow a
batch from file bytes to the GPU):

  source      where the bytes come from (ImageFolder, FileList, TarShards, Samples);
              remote (fsspec URLs, retries, prefetch), tarindex, shards (the writer)
  decode      bytes -> pixels: JPEG by the native kernel, other formats by Pillow
  transforms  what each sample becomes: RandomResizedCrop, CenterCrop
  augment     per-example ops after the crop: ColorJitter, RandomGrayscale,
              TrivialAugmentWide, RandomErasing (in workers or per emission)
  ring        shared-memory ring of batch slots (layout and atomics in C)
  workers     processes that fill slots; Plan and Shard say which samples
  loader      the consumer end: ordered zero-copy batches, supervision, clean-up
  echo        data echoing: Echo, echo counts, the shuffle buffer, auto echo
  output      Output: normalisation, layout, dtype; BFloat16Array
  mix         MixUp / CutMix with soft targets, and the user's batch op
  backends    where echoes are made: NumPy on the CPU, CuPy on a GPU
  pipeline    EchoRing, which wires the specs to all of the above

The lab (benchmark corpus, peers, demo) is :mod:`echo_native.lab`; the library
never imports it.
"""
from echo_native.errors import DecodeError
from echo_native.source import FileList, ImageFolder, Samples, TarShards
from echo_native.remote import RemoteOptions
from echo_native.shards import write_shards
from echo_native.decode import (
    DecodeLimits,
    Decoder,
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
from echo_native.transforms import CenterCrop, RandomResizedCrop
from echo_native.augment import ColorJitter, RandomErasing, RandomGrayscale, TrivialAugmentWide
from echo_native.ring import RingMemoryError
from echo_native.workers import Shard
from echo_native.loader import Batch, Loader, SampleFailureWarning, WorkerError, merge_states
from echo_native.echo import Echo
from echo_native.output import BFloat16Array, DeviceArray, Output
from echo_native.mix import Mix
from echo_native.pipeline import EchoRing

__version__ = "0.2.0"

__all__ = [
    "BFloat16Array",
    "Batch",
    "CenterCrop",
    "ColorJitter",
    "DecodeError",
    "DecodeLimits",
    "DeviceArray",
    "Decoder",
    "Echo",
    "EchoRing",
    "FileList",
    "ImageFolder",
    "Loader",
    "Mix",
    "Output",
    "RandomErasing",
    "RandomGrayscale",
    "RandomResizedCrop",
    "RemoteOptions",
    "RingMemoryError",
    "SampleFailureWarning",
    "Samples",
    "Shard",
    "TarShards",
    "TrivialAugmentWide",
    "WorkerError",
    "__version__",
    "center_crop_box",
    "decode",
    "decode_canvas",
    "decode_center_crop",
    "decode_crop",
    "decode_random_crop",
    "image_size",
    "merge_states",
    "pick_scale",
    "random_resized_crop_params",
    "resize_crop",
    "write_shards",
]
