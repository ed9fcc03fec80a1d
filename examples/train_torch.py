"""Train a small ResNet with PyTorch, fed by EchoRing (data echoing), with checkpoints and DDP.

What it shows:
  - a training ring (RandomResizedCrop + echo) and an evaluation ring
    (CenterCrop, echo=1, shuffle=False) with one output contract: normalised
    float32 NCHW, handed to torch with ``torch.from_dlpack`` (no copy);
  - ``ring.set_epoch``, ``ring.stats()`` once per epoch, and exact resume:
    ``ring.state_dict()`` is saved with the model and optimizer, and
    ``ring.load_state_dict()`` continues the fresh stream where it stopped,
    also under another number of ranks (every rank's state is saved);
  - DistributedDataParallel under torchrun: each rank's ring reads its own
    shard (EchoRing takes RANK / WORLD_SIZE from torchrun's environment).

Run it (the default data is the built-in ImageNet-like corpus, 2,000 photo
crops whose 10 labels are arbitrary: it exercises the pipeline, and accuracy
stays at chance; for data a model can learn, make Fashion-MNIST (Debian's
``dataset-fashion-mnist``) with ``echo-native-lab make-dataset fashion-mnist fm``
and pass ``--data fm/train --val-data fm/test --image-size 28``):

    python examples/train_torch.py --epochs 2
    python examples/train_torch.py --data /data/train --val-data /data/val --echo auto
    python examples/train_torch.py --steps 50 --checkpoint ckpt.pt            # stop after 50 steps
    python examples/train_torch.py --steps 100 --checkpoint ckpt.pt --resume  # ... and go on to 100
    torchrun --nproc_per_node=2 examples/train_torch.py --epochs 1            # DDP: gloo on CPU
    torchrun --nproc_per_node=2 examples/train_torch.py --device cuda         # DDP: nccl on GPUs

Like most training scripts it has no ``if __name__ == "__main__":`` guard:
EchoRing's worker processes never run this file.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import echo_native as en
from echo_native.lab.corpus import default_corpus


def echo_arg(text):
    return text if text == "auto" else float(text)


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data", help="an ImageFolder (default: the built-in corpus)")
parser.add_argument("--val-data", help="a separate validation ImageFolder (default: --data)")
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=32, help="per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, help="stop after this many optimizer steps in total")
parser.add_argument("--echo", type=echo_arg, default=2.0, help="echo factor (>= 1) or 'auto'")
parser.add_argument("--placement", default="before_augment",
                    choices=["before_augment", "after_augment", "batch"])
parser.add_argument("--workers", type=int, default=2, help="decoding processes per rank")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--checkpoint", help="save here after each epoch and when --steps stops")
parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
args = parser.parse_args()
if args.resume and not args.checkpoint:
    parser.error("--resume needs --checkpoint")

# ---- processes and devices ------------------------------------------------------------
distributed = "WORLD_SIZE" in os.environ  # started by torchrun
if distributed:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.echo == "auto":
        # auto echo may give the ranks different step counts; DDP needs the same on all.
        parser.error("use a fixed --echo with DDP (every rank must take the same steps)")
else:
    rank, world = 0, 1
if args.device == "cuda":
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
else:
    device = torch.device("cpu")
main = rank == 0  # only rank 0 prints and saves


# ---- the model: a small ResNet ----------------------------------------------------------
class Block(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (ResNet's basic block)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, classes, width=32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width, width), Block(width, 2 * width, 2),
                                    Block(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))  # global average pooling


# ---- data -------------------------------------------------------------------------------
train = en.ImageFolder(args.data or default_corpus())
val = en.ImageFolder(args.val_data or args.data or default_corpus())
size = args.image_size
out = en.Output(normalize=True, layout="NCHW")   # float32, ImageNet mean/std
ring_device = str(device) if args.device == "cuda" else "cpu"
ring = en.EchoRing(train, args.batch_size, augment=en.RandomResizedCrop(size),
                   echo=en.Echo(args.echo, placement=args.placement), output=out,
                   workers=args.workers, device=ring_device, seed=0)
val_ring = en.EchoRing(val, args.batch_size,
                       augment=en.CenterCrop(size, resize=round(size / 0.875)),
                       echo=1, shuffle=False, output=out, workers=args.workers,
                       device=ring_device)

model = ResNet(len(train.classes)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
start_epoch, step = 0, 0
if args.resume and os.path.exists(args.checkpoint):
    ckpt = torch.load(args.checkpoint, map_location=device)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    # Every rank's saved position: the epoch's unread samples are split over this
    # job's ranks, so a checkpoint of 2 ranks resumes on 1, 2 or 4.
    ring.load_state_dict(ckpt["ring"])
    # ring.epoch is now ckpt["epoch"], or the next one if the run stopped on an
    # epoch's last batch: the restored position knows which.
    start_epoch, step = ring.epoch, ckpt["step"]
    if main:
        print(f"resumed from {args.checkpoint}: epoch {start_epoch}, step {step}")
net: nn.Module = model
if distributed:
    net = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if args.device == "cuda" else None)
if main:
    print(f"{len(train)} training images, {len(train.classes)} classes, {size}x{size}, "
          f"world size {world} ({'DDP, ' + dist.get_backend() if distributed else 'one process'})"
          f", device {device}, echo {args.echo} ({args.placement})")


def to_torch(batch):
    x = torch.from_dlpack(batch.images)             # (B, 3, size, size) float32, no copy,
    y = torch.from_dlpack(batch.labels).to(device)  # on the ring's device; labels on the host
    return x, y


def validate():
    """Top-1 over every validation sample once (each rank its share, summed)."""
    model.eval()
    right_total = torch.zeros(2, dtype=torch.int64, device=device)
    with torch.no_grad():
        for batch in val_ring:
            x, y = to_torch(batch)
            right_total[0] += (model(x).argmax(1) == y).sum()
            right_total[1] += len(y)
    if distributed:
        dist.all_reduce(right_total)
    model.train()
    return (right_total[0] / right_total[1]).item()


def save(epoch):
    """Model, optimizer, every rank's ring position, epoch and step (rank 0 writes)."""
    states = [None] * world
    if distributed:
        dist.all_gather_object(states, ring.state_dict())
    else:
        states = [ring.state_dict()]
    if main:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "ring": states, "epoch": epoch, "step": step}, args.checkpoint)


# ---- the loop ---------------------------------------------------------------------------
acc = float("nan")
with ring, val_ring:
    for epoch in range(start_epoch, args.epochs):
        if args.steps and step >= args.steps:
            break
        ring.set_epoch(epoch)  # keeps a position restored mid-epoch
        t0, losses = time.perf_counter(), []
        for batch in ring:
            x, y = to_torch(batch)
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if args.steps and step >= args.steps:
                break
        stopped = bool(args.steps and step >= args.steps)
        acc = validate()
        if args.checkpoint:
            save(epoch if stopped else epoch + 1)
        if main:
            s = ring.stats()
            print(f"epoch {epoch}: step {step}, loss {sum(losses) / max(1, len(losses)):.3f}, "
                  f"val top-1 {acc:.3f}, {time.perf_counter() - t0:.1f} s | "
                  f"fresh {s['fresh_per_s']:.0f}/s, delivered {s['delivered_per_s']:.0f}/s, "
                  f"effective echo {s['effective_echo']:.2f} (e={s['echo_factor']:.2f}), "
                  f"R~{s['estimated_R']:.2f}, stalled {s['stall_s']:.1f} s, "
                  f"ring {s['ring_occupancy']:.0%} full, failures {s['failures'] or 0}")
        if stopped:
            break
    s = ring.stats()

if main:
    print(f"done: {step} steps, {s['fresh']} fresh images, {s['delivered']} delivered "
          f"(effective echo {s['effective_echo']:.2f}), val top-1 {acc:.3f}")
if distributed:
    dist.destroy_process_group()
