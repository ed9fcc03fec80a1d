"""echo_native: a fast image input pipeline with data echoing.

Pipeline order, one module per stage (open them in this order to follow a
batch from file bytes to the GPU; each imports only modules above it):

  errors      DecodeError and the other errors the pipeline raises;
              remote_errors (storage errors told apart, said without credentials)
  memory      what the machine's memory allows: a ring, an echo buffer, an annotation
              parse (the budget); /dev/shm names
  protocol    what a source is: Source (len, labels, read) and its optional hooks;
              ObjectField (what an object may carry beside its box and label)
  remote      objects in storage by URL: bounded, retried reads (fsspec);
              prefetch (reads ahead of the decode: samples, tar-shard blocks)
  labels      a source's labels checked: one integer per sample
  keypoints   a pose's keypoints: which point mirrors which, where points land
              (the KEYPOINTS field); masks (instance masks: polygons and RLE checked
              and packed, rasterised in a window, bit-packed: the MASKS field)
  targets     a detection sample's boxes and labels (Targets), their JSON form, and
              what else an object carries (OBJECT_FIELDS: keypoints, masks)
  files       local files read safely: bounded reads, packed paths, a walk that
              enters each directory once
  source      where the bytes come from: ImageFolder, FileList, Samples;
              tarindex (a tar shard's index), tarshards (TarShards),
              coco (CocoDetection: a COCO-format folder with its annotations),
              parquet_index (Parquet footers and row groups), parquet (ParquetImages:
              Parquet files and Hugging Face datasets)
  seekable    JPEGs with restart markers and an index: a crop decodes only its blocks
  decode      bytes -> pixels: JPEG by the native kernel, other formats by Pillow;
              shards (the shard writer, which checks images with it)
  transforms  what each sample becomes: RandomResizedCrop, CenterCrop
  detection   box-aware geometry: RandomZoomOut, RandomIoUCrop, RandomHorizontalFlip,
              Resize, SanitizeBoundingBoxes (torchvision v2's semantics)
  boxes       where boxes land: through each crop, flip and resize; Objects
  augment     per-example ops after the crop: ColorJitter, RandomGrayscale,
              TrivialAugmentWide, RandomErasing (in workers or per emission)
  plan        which samples each batch (ticket) holds: Plan, Shard
  failures    failed samples: the binary records a slot carries, and their warnings
  ring        the shared-memory ring of batch slots (layout and atomics in C)
  workers     what a worker does: fill the slot of each ticket it takes
  pool        the supervisor: starts workers, replaces the dead, redoes their tickets
  batch       Batch, and the Fresh batch an echo stage takes
  resume      the loader's state format, its checks, elastic resume (merge_states)
  specs       the constructor's arguments as specs, folded once (Workers)
  loader      the ring's consumer end: ordered zero-copy batches, supervision
  echo        data echoing: Echo, counts, shuffle buffer, auto echo, the stages
              and their state (the loader's nested in it; merge_states of them)
  output      Output: normalisation, layout, dtype; BFloat16Array
  mix         MixUp / CutMix with soft targets
  backends    where echoes are made: NumPy on the CPU, CuPy on a GPU
  delivery    an emission becomes the consumer's batch (normalise, Mix, on_batch)
  pipeline    EchoRing, which wires the specs to all of the above
  echo_loader EchoLoader: the echo stages around any loader's batches
  ray_decode  a ticket decoded in a Ray actor, as a worker fills a slot;
              ray (the [ray] extra: EchoRing and dataset() decoding on a Ray cluster)

The lab (benchmark corpus, peers, demo) is :mod:`echo_native.lab`; the library
never imports it.
"""
from echo_native.errors import DecodeError
from echo_native.protocol import Source
from echo_native.targets import Targets
from echo_native.keypoints import Keypoints
from echo_native.source import FileList, ImageFolder, Samples
from echo_native.coco import CocoDetection
from echo_native.parquet import ParquetImages, from_datasets
from echo_native.tarshards import TarShards
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
from echo_native.detection import (RandomHorizontalFlip, RandomIoUCrop, RandomZoomOut, Resize,
                                   SanitizeBoundingBoxes)
from echo_native.boxes import Objects
from echo_native.augment import ColorJitter, RandomErasing, RandomGrayscale, TrivialAugmentWide
from echo_native.plan import Shard
from echo_native.memory import RingMemoryError
from echo_native.batch import Batch
from echo_native.specs import Workers
from echo_native.failures import SampleFailureWarning
from echo_native.loader import Loader, WorkerError
from echo_native.echo import Echo
from echo_native.echo.state import merge_states
from echo_native.output import BFloat16Array, DeviceArray, Output
from echo_native.mix import Mix
from echo_native.pipeline import EchoRing
from echo_native.echo_loader import EchoLoader

__version__ = "0.2.0"

__all__ = [
    "BFloat16Array",
    "Batch",
    "CenterCrop",
    "CocoDetection",
    "ColorJitter",
    "DecodeError",
    "DecodeLimits",
    "DeviceArray",
    "Decoder",
    "Echo",
    "EchoLoader",
    "EchoRing",
    "FileList",
    "ImageFolder",
    "Keypoints",
    "Loader",
    "Mix",
    "Objects",
    "Output",
    "ParquetImages",
    "RandomErasing",
    "RandomGrayscale",
    "RandomHorizontalFlip",
    "RandomIoUCrop",
    "RandomResizedCrop",
    "RandomZoomOut",
    "RemoteOptions",
    "Resize",
    "RingMemoryError",
    "SampleFailureWarning",
    "Samples",
    "SanitizeBoundingBoxes",
    "Source",
    "Shard",
    "TarShards",
    "Targets",
    "TrivialAugmentWide",
    "WorkerError",
    "Workers",
    "__version__",
    "center_crop_box",
    "decode",
    "decode_canvas",
    "decode_center_crop",
    "decode_crop",
    "decode_random_crop",
    "from_datasets",
    "image_size",
    "merge_states",
    "pick_scale",
    "random_resized_crop_params",
    "resize_crop",
    "write_shards",
]
