"""One rank of the real multi-process test (``tests/test_distributed.py``).

Run by ``torchrun --standalone --nproc_per_node=2 dist_worker.py ROOT OUT EPOCHS MODE``:
every rank joins a gloo process group on CPU, builds an ``EchoRing`` over the
ImageFolder at ROOT with rank/world size taken from torchrun's environment,
iterates EPOCHS epochs calling ``set_epoch(e)`` first, and per epoch
all-gathers its fresh sample ids, step count and ``len(ring)``; rank 0 writes
the gathered records to the JSON file OUT.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta


def main(root, out, epochs, mode):
    import numpy as np
    import torch
    import torch.distributed as dist

    import echo_native as en

    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        ring = en.EchoRing(en.ImageFolder(root), batch_size=8, image_size=32, echo=2,
                           workers=1, worker_mode=mode, seed=7)
        plan = ring.loader.plan
        assert (plan.rank, plan.world_size) == (rank, world), (plan, rank, world)
        records = []
        with ring:
            for epoch in range(epochs):
                ring.set_epoch(epoch)
                expected = len(ring)
                fresh, delivered, steps = [], 0, 0
                for b in ring:
                    fresh.extend(np.asarray(b.sample_ids)[np.asarray(b.fresh)].tolist())
                    delivered += len(b)
                    steps += 1
                    # a training step's collective: ranks stepping unevenly would hang here
                    t = torch.ones(1)
                    dist.all_reduce(t)
                    assert t.item() == world
                mine = {"rank": rank, "epoch": epoch, "fresh": fresh, "steps": steps,
                        "len": expected,
                        "delivered": delivered, "pid": os.getpid()}
                gathered = [None] * world
                dist.all_gather_object(gathered, mine)
                records.append(gathered)
        if rank == 0:
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"world_size": world, "epochs": records}, f)
            os.replace(tmp, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
