"""Decode on a Ray cluster, echo on the trainer: a NumPy classifier fed by echo_native.ray.

What it shows:
  - ``from echo_native.ray import EchoRing``: the local ring's interface, its
    batches decoded by actors on every node of the cluster ``ray.init`` joined;
  - an exact resume point (``state_dict()``) taken each epoch, and the books the
    Ray ring adds to ``stats()`` (bytes from the cluster per fresh example,
    rows Ray delivered twice and the trainer dropped);
  - one JSON line per epoch, with a check that every id was delivered fresh once.

Run it on this machine (a local Ray instance starts), or on a cluster:

    python examples/train_ray.py path/to/imagefolder --epochs 2
    ray start --head --num-cpus 4          # on the head; `ray start --address=HEAD:6379` on others
    python examples/train_ray.py path/to/imagefolder --address auto

Like most training scripts it has no ``if __name__ == "__main__":`` guard: the
decoding actors never run this file.
"""
import argparse
import json
import time

import numpy as np
import ray

import echo_native as en
from echo_native.ray import EchoRing

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("data", help="an ImageFolder")
parser.add_argument("--address", default=None, help="a Ray cluster ('auto', or host:port)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--echo", type=float, default=2.0)
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--concurrency", type=int, default=None,
                    help="decoding actors (default: one per CPU of the cluster)")
parser.add_argument("--expect-nodes", type=int, default=None,
                    help="fail unless the cluster has this many nodes (a test's check)")
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

ray.init(address=args.address, include_dashboard=False, log_to_driver=False,
         configure_logging=False)
nodes = sum(1 for n in ray.nodes() if n["Alive"])
if args.expect_nodes is not None and nodes != args.expect_nodes:
    raise SystemExit(f"expected {args.expect_nodes} nodes, the cluster has {nodes}")
source = en.ImageFolder(args.data)
classes = len(source.classes)
ring = EchoRing(source, args.batch_size, augment=en.RandomResizedCrop(args.image_size),
                echo=args.echo, seed=0, concurrency=args.concurrency)

# Softmax regression on 8x8 mean-pooled pixels (192 features).
POOL = 8
rng = np.random.default_rng(0)
W = rng.normal(0, 0.01, (POOL * POOL * 3, classes)).astype(np.float32)
b = np.zeros(classes, np.float32)


def features(images):
    n, h, w, _ = images.shape
    x = images[:, :h - h % POOL, :w - w % POOL].astype(np.float32) / 255.0
    x = x.reshape(n, POOL, (h - h % POOL) // POOL, POOL, (w - w % POOL) // POOL, 3)
    return x.mean(axis=(2, 4)).reshape(n, -1) - 0.5


with ring:
    for epoch in range(args.epochs):
        ring.set_epoch(epoch)
        t0, losses, fresh = time.perf_counter(), [], []
        for batch in ring:
            x, y = features(batch.images), batch.labels
            logits = x @ W + b
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            losses.append(float(-np.log(p[np.arange(len(y)), y] + 1e-9).mean()))
            p[np.arange(len(y)), y] -= 1.0
            W -= args.lr * x.T @ p / len(y)
            b -= args.lr * p.mean(axis=0)
            fresh.append(batch.sample_ids[batch.fresh])
        checkpoint = ring.state_dict()   # save it with the model to resume mid-epoch
        ids = np.concatenate(fresh)
        stats = ring.stats()
        print(json.dumps({
            "epoch": epoch, "loss": float(np.mean(losses)), "batches": len(losses),
            "fresh_ids": int(len(ids)),
            "each_once": bool(len(np.unique(ids)) == len(ids) == len(source)),
            "seconds": round(time.perf_counter() - t0, 3), "nodes": nodes,
            "delivered_per_s": round(stats["delivered_per_s"], 1),
            "ray_bytes_per_fresh": round(stats["ray_bytes_per_fresh"]),
            "duplicates_dropped": stats["duplicates"],
            "checkpoint_ticket": checkpoint["parent"]["ticket"]}), flush=True)
ray.shutdown()
