"""The same four jobs on one folder, for comparing two trees of echo_native: run it once
per tree (PYTHONPATH=<tree>), alternating, and compare the JSON lines it prints.

    python benchmarks/before_after.py FOLDER LABEL

Jobs (images/s after the first batch, two epochs, 2 workers, RandomResizedCrop 224):
Loader, EchoRing(echo=1), echo 2 before augmentation, echo 2 after augmentation.
docs/results.md ("The house, round two: before and after") used it."""
import json, sys, time
import echo_native as en

folder, which = sys.argv[1], sys.argv[2]
out = {"tree": which}

def rate(make, epochs=2):
    with make() as it:
        n, t0 = 0, None
        for e in range(epochs + 1):
            if hasattr(it, "set_epoch"):
                it.set_epoch(e)
            for b in it:
                if t0 is None:           # the first batch starts the clock (workers up)
                    t0 = time.perf_counter()
                    continue
                n += len(b)
    return n / (time.perf_counter() - t0)

out["loader"] = rate(lambda: en.Loader(folder, 64, image_size=224, workers=2, seed=0))
out["echo1"] = rate(lambda: en.EchoRing(folder, 64, image_size=224, workers=2, echo=1, seed=0))
out["before_e2"] = rate(lambda: en.EchoRing(folder, 64, image_size=224, workers=2, echo=2,
                                            placement="before_augment", seed=0))
out["after_e2"] = rate(lambda: en.EchoRing(folder, 64, image_size=224, workers=2, echo=2,
                                           placement="after_augment", seed=0))
print(json.dumps(out))
