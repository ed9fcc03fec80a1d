"""One rank of the real multi-process test (``tests/test_distributed.py``).

Run by ``torchrun --standalone --nproc_per_node=2 dist_worker.py ROOT OUT EPOCHS MODE``:
every rank joins a gloo process group on CPU, builds an ``EchoRing`` over the
ImageFolder at ROOT with rank/world size taken from torchrun's environment,
iterates EPOCHS epochs calling ``set_epoch(e)`` first, and per epoch
all-gathers its fresh sample ids, step count and ``len(ring)``; rank 0 writes
the gathered records to the JSON file OUT.

``dist_worker.py elastic ROOT OUT STOP [STATES]`` is one job of the elastic
resume test: an echo-2 ring (thread workers) loads the list of all ranks'
states from the JSON file STATES if given, then runs STOP steps of the current
epoch (-1: the rest of it, then the whole next one); every rank's record (fresh
ids, steps, ``len(ring)``) and, when it stopped early, its ``state_dict()`` are
all-gathered and rank 0 writes them to OUT.
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


def elastic(root, out, stop, states=None):
    import numpy as np
    import torch
    import torch.distributed as dist

    import echo_native as en

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        ring = en.EchoRing(en.ImageFolder(root), batch_size=4, image_size=16, echo=2,
                           workers=1, worker_mode="thread", seed=11)
        if states is not None:
            with open(states) as f:
                ring.load_state_dict(json.load(f))  # every saved rank's state

        def run(limit):
            fresh, steps = [], 0
            for b in ring:
                fresh.extend(np.asarray(b.sample_ids)[np.asarray(b.fresh)].tolist())
                steps += 1
                t = torch.ones(1)
                dist.all_reduce(t)  # ranks stepping unevenly would hang here
                if steps == limit:
                    break
            return fresh, steps

        mine = {"rank": rank, "epoch": ring.epoch, "len": len(ring)}
        with ring:
            ring.set_epoch(ring.epoch)  # keeps the restored position
            mine["fresh"], mine["steps"] = run(stop)
            if stop > 0:
                mine["state"] = ring.state_dict()
            else:
                ring.set_epoch(mine["epoch"] + 1)
                mine["next_len"] = len(ring)
                mine["next_fresh"], mine["next_steps"] = run(-1)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            with open(out + ".tmp", "w") as f:
                json.dump({"world_size": world, "ranks": gathered}, f)
            os.replace(out + ".tmp", out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "elastic":
        elastic(sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
