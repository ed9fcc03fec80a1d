"""The bare feeder in a hand-written loop: a linear classifier in NumPy, and how to read stats().

What it shows:
  - EchoRing's default output (uint8 NHWC, no framework involved) and the
    per-example fields of a batch (labels, fresh, echo_index);
  - a training step that is a real NumPy computation (softmax regression on
    pooled pixels) plus ``--step-ms`` of sleep standing for a bigger model, so
    that you can watch echoing trade repeats for stalls;
  - ``ring.stats()``, every number explained in the comments below.

Run it (the default data is the built-in ImageNet-like corpus, 2,000 photo
crops whose 10 labels are arbitrary: it exercises the pipeline, and accuracy
stays at chance; for data a model can learn, make Fashion-MNIST (Debian's
``dataset-fashion-mnist``) with ``echo-native-lab make-dataset fashion-mnist fm``
and pass ``--data fm/train --image-size 28``):

    python examples/custom_loop_numpy.py --steps 100
    python examples/custom_loop_numpy.py --steps 100 --echo 1 --step-ms 0   # input-bound
    python examples/custom_loop_numpy.py --steps 100 --echo auto --workers 1

Like most training scripts it has no ``if __name__ == "__main__":`` guard:
EchoRing's worker processes never run this file.
"""
import argparse
import time

import numpy as np

import echo_native as en
from echo_native.lab.corpus import default_corpus


def echo_arg(text):
    return text if text == "auto" else float(text)


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data", help="an ImageFolder (default: the built-in corpus)")
parser.add_argument("--val-data", help="a separate validation ImageFolder (default: --data)")
parser.add_argument("--steps", type=int, default=200, help="stop after this many steps")
parser.add_argument("--echo", type=echo_arg, default=2.0, help="echo factor (>= 1) or 'auto'")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--workers", type=int, default=2, help="decoding processes")
parser.add_argument("--step-ms", type=float, default=20.0,
                    help="simulated model time per step, on top of the NumPy step")
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

source = en.ImageFolder(args.data or default_corpus())
classes = len(source.classes)
ring = en.EchoRing(source, args.batch_size, augment=en.RandomResizedCrop(args.image_size),
                   echo=args.echo, workers=args.workers, seed=0)   # output: uint8 NHWC
# Validation: every sample once, in order, torchvision's Resize + CenterCrop.
val_ring = en.EchoRing(en.ImageFolder(args.val_data or args.data or default_corpus()),
                       args.batch_size, augment=en.CenterCrop(args.image_size),
                       echo=1, shuffle=False, workers=args.workers)

# Softmax regression on 8x8 mean-pooled pixels (192 features).
POOL = 8
W = np.zeros((POOL * POOL * 3, classes))
b = np.zeros(classes)


def features(images):
    n, h, w, _ = images.shape
    x = images[:, :h // POOL * POOL, :w // POOL * POOL].astype(np.float32) / 255.0
    x = x.reshape(n, POOL, h // POOL, POOL, w // POOL, 3).mean(axis=(2, 4))
    return (x.reshape(n, -1) - 0.45) / 0.25


step, right, seen, repeats = 0, 0, 0, 0
with ring:
    epoch = 0
    while step < args.steps:
        ring.set_epoch(epoch)
        for batch in ring:
            # batch.images: (B, H, W, 3) uint8, a view valid until the batch after next.
            x, y = features(batch.images), batch.labels
            repeats += int((batch.echo_index > 0).sum())   # 0: first emission, k: k-th repeat
            logits = x @ W + b
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            right += int((p.argmax(axis=1) == y).sum())
            seen += len(y)
            p[np.arange(len(y)), y] -= 1.0                  # d(cross-entropy)/d(logits)
            W -= args.lr * x.T @ p / len(y)
            b -= args.lr * p.mean(axis=0)
            time.sleep(args.step_ms / 1000)                 # the rest of a "real" model
            step += 1
            if step % 50 == 0 or step == args.steps:
                print(f"step {step}: running train accuracy {right / seen:.3f}")
            if step == args.steps:
                break
        epoch += 1
    s = ring.stats()

with val_ring:
    val_right = val_seen = 0
    for batch in val_ring:
        val_right += int(((features(batch.images) @ W + b).argmax(axis=1) == batch.labels).sum())
        val_seen += len(batch)
print(f"validation accuracy {val_right / val_seen:.3f} over {val_seen} images")

# What stats() says (all counted since the ring started):
print("stats():")
# fresh: examples read and decoded by the workers and taken into the echo
#   stage, each exactly once: the work the input pipeline did.
# delivered: examples this loop received, fresh ones and repeats together.
print(f"  fresh           {s['fresh']}")
print(f"  delivered       {s['delivered']}")
# fresh_per_s, delivered_per_s: the two counts over the wall-clock time since
#   start. delivered_per_s is what the model consumes; with echo it can
#   exceed what the workers alone could supply (fresh_per_s).
print(f"  fresh_per_s     {s['fresh_per_s']:.0f}")
print(f"  delivered_per_s {s['delivered_per_s']:.0f}")
# effective_echo: delivered / fresh, the repeat factor actually achieved. It
#   is below echo_factor early on, while the shuffle buffer fills with fresh
#   examples not yet (fully) emitted, and meets it over whole epochs.
print(f"  effective_echo  {s['effective_echo']:.2f}")
# echo_factor: the e in use: the --echo you gave, or auto's current choice
#   (auto raises e while the loop stalls, lowers it while fresh data waits).
print(f"  echo_factor     {s['echo_factor']:.2f}")
# estimated_R: upstream / downstream time per batch, i.e. the workers' time to
#   fill one batch (divided by their number) over the time this loop spends on
#   one batch. R > 1: the input pipeline is the bottleneck and an echo factor
#   up to about R buys steps for free; R < 1: the model is the bottleneck and
#   echo=1 loses nothing. `echo-native profile DIR` measures it before training.
print(f"  estimated_R     {s['estimated_R']:.2f}")
# stall_s: seconds this loop waited for fresh batches from the ring: the time
#   an accelerator would have sat idle. Echoing exists to shrink it.
print(f"  stall_s         {s['stall_s']:.2f}   (loop body: {s['consumer_s']:.2f} s)")
# ring_occupancy: the share of ring slots filled and waiting right now. Near 1
#   the workers are ahead (model-bound); near 0 they cannot keep up.
print(f"  ring_occupancy  {s['ring_occupancy']:.2f}")
# failures: {reason: count} of samples that could not be read or decoded; each
#   was replaced by another sample (on_error="replace") and reported by path.
print(f"  failures        {s['failures']}")
# The counts add up: every delivered example is a first emission or a repeat, and a
# fresh example not yet emitted is still waiting in the echo stage's buffer.
first = s["delivered"] - repeats
print(f"done: {step} steps, {s['fresh']} fresh images, {s['delivered']} delivered "
      f"({first} first emissions + {repeats} repeats; {s['fresh'] - first} fresh images "
      f"not yet emitted, in the echo buffer), effective echo {s['effective_echo']:.2f}, "
      f"train accuracy {right / max(1, seen):.3f}")
