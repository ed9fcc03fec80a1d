"""Train a small CNN in plain JAX (jax.numpy + jax.grad), fed by EchoRing with data echoing.

What it shows:
  - EchoRing delivering normalised float32 NHWC batches (JAX's natural
    layout), taken into JAX with ``jax.dlpack.from_dlpack`` (no copy on CPU);
  - a hand-written SGD-with-momentum step under ``jax.jit``, no flax/optax;
  - the evaluation path (CenterCrop, echo=1, shuffle=False): every
    validation image once, in order, for top-1 accuracy after each epoch.

JAX: CPU JAX from PyPI (``pip install jax``) is enough.

Run it (the default data is the built-in ImageNet-like corpus, 2,000 photo
crops whose 10 labels are arbitrary: it exercises the pipeline, and accuracy
stays at chance; for data a model can learn, make Fashion-MNIST (Debian's
``dataset-fashion-mnist``) with ``echo-native-lab make-dataset fashion-mnist fm``
and pass ``--data fm/train --val-data fm/test --image-size 28``):

    python examples/train_jax.py --epochs 2
    python examples/train_jax.py --data /data/train --val-data /data/val --echo 3
    python examples/train_jax.py --steps 20 --echo auto

Like most training scripts it has no ``if __name__ == "__main__":`` guard:
EchoRing's worker processes never run this file.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import echo_native as en
from echo_native.lab.corpus import default_corpus


def echo_arg(text):
    return text if text == "auto" else float(text)


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data", help="an ImageFolder (default: the built-in corpus)")
parser.add_argument("--val-data", help="a separate validation ImageFolder (default: --data)")
parser.add_argument("--image-size", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, help="stop after this many optimizer steps in total")
parser.add_argument("--echo", type=echo_arg, default=2.0, help="echo factor (>= 1) or 'auto'")
parser.add_argument("--placement", default="before_augment",
                    choices=["before_augment", "after_augment", "batch"])
parser.add_argument("--workers", type=int, default=2, help="decoding processes")
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

# ---- data -------------------------------------------------------------------------------
train = en.ImageFolder(args.data or default_corpus())
val = en.ImageFolder(args.val_data or args.data or default_corpus())
size = args.image_size
out = en.Output(normalize=True, layout="NHWC")   # float32, ImageNet mean/std
# drop_last: every training batch has the same shape, so the step compiles once.
ring = en.EchoRing(train, args.batch_size, augment=en.RandomResizedCrop(size),
                   echo=en.Echo(args.echo, placement=args.placement), output=out,
                   workers=args.workers, drop_last=True, seed=0)
val_ring = en.EchoRing(val, args.batch_size,
                       augment=en.CenterCrop(size, resize=round(size / 0.875)),
                       echo=1, shuffle=False, output=out, workers=args.workers)


# ---- the model: three strided 3x3 convolutions, global average pooling, a linear layer --
def init(key, classes, widths=(3, 16, 32, 64)):
    params = {}
    keys = jax.random.split(key, len(widths))
    for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:])):
        w = jax.random.normal(keys[i], (3, 3, cin, cout)) * jnp.sqrt(2.0 / (9 * cin))
        params[f"conv{i}"] = (w, jnp.zeros(cout))
    w = jax.random.normal(keys[-1], (widths[-1], classes)) * jnp.sqrt(1.0 / widths[-1])
    params["fc"] = (w, jnp.zeros(classes))
    return params


def forward(params, x):
    for i in range(3):
        w, b = params[f"conv{i}"]
        x = jax.lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = jax.nn.relu(x + b)
    w, b = params["fc"]
    return x.mean(axis=(1, 2)) @ w + b


def loss_fn(params, x, y):
    logp = jax.nn.log_softmax(forward(params, x))
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


@jax.jit
def train_step(params, velocity, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    velocity = jax.tree_util.tree_map(lambda v, g: 0.9 * v + g, velocity, grads)
    params = jax.tree_util.tree_map(lambda p, v: p - args.lr * v, params, velocity)
    return params, velocity, loss


@jax.jit
def correct(params, x, y):
    return (forward(params, x).argmax(axis=1) == y).sum()


def to_jax(batch):
    # Zero-copy views of the ring's output buffer, which is reused two batches
    # later: the loop below waits for each step (float(loss)) before taking the
    # next batch, so JAX's asynchronous dispatch never reads a reused buffer.
    return jax.dlpack.from_dlpack(batch.images), jax.dlpack.from_dlpack(batch.labels)


def validate(params):
    right = total = 0
    for batch in val_ring:
        x, y = to_jax(batch)
        right += int(correct(params, x, y))
        total += len(batch)
    return right / total


params = init(jax.random.PRNGKey(0), len(train.classes))
velocity = jax.tree_util.tree_map(jnp.zeros_like, params)
print(f"{len(train)} training images, {len(train.classes)} classes, {size}x{size}, "
      f"jax {jax.__version__} on {jax.devices()[0].platform}, echo {args.echo} ({args.placement})")

# ---- the loop ---------------------------------------------------------------------------
step, acc = 0, float("nan")
with ring, val_ring:
    for epoch in range(args.epochs):
        ring.set_epoch(epoch)
        t0, losses = time.perf_counter(), []
        for batch in ring:
            x, y = to_jax(batch)
            params, velocity, loss = train_step(params, velocity, x, y)
            losses.append(float(loss))  # waits for the step: the batch may be reused now
            step += 1
            if args.steps and step >= args.steps:
                break
        acc = validate(params)
        s = ring.stats()
        print(f"epoch {epoch}: step {step}, loss {np.mean(losses):.3f}, val top-1 {acc:.3f}, "
              f"{time.perf_counter() - t0:.1f} s | fresh {s['fresh_per_s']:.0f}/s, "
              f"delivered {s['delivered_per_s']:.0f}/s, effective echo "
              f"{s['effective_echo']:.2f} (e={s['echo_factor']:.2f}), "
              f"R~{s['estimated_R']:.2f}, stalled {s['stall_s']:.1f} s")
        if args.steps and step >= args.steps:
            break
    s = ring.stats()

print(f"done: {step} steps, {s['fresh']} fresh images, {s['delivered']} delivered "
      f"(effective echo {s['effective_echo']:.2f}), val top-1 {acc:.3f}")
