"""The workers (``echo_native.workers``): the Plan that says which samples each ticket
holds (a pure function of seed and epoch), and the WorkerPool's accounting of the
tickets a dead worker left unfinished.  Killed, failing and hung workers end to end
are in ``robustness/test_faults.py``; rank sharding of the plan in
``test_distributed.py``."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import echo_native as en
from echo_native.ring import Ring
from echo_native.plan import Plan
from echo_native.pool import WorkerPool

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import ring_helpers as rh  # noqa: E402


# ---- the plan --------------------------------------------------------------------------------
def test_plan_order_is_a_pure_function_of_seed_and_epoch():
    """Plan.epoch_order depends only on (seed, epoch) and is a permutation."""
    t = en.RandomResizedCrop((8, 8))
    p = Plan(100, 7, t, seed=4)              # (samples, batch size, transform)
    q = Plan(100, 3, t, seed=4)
    assert np.array_equal(p.epoch_order(3), q.epoch_order(3))
    assert sorted(p.epoch_order(3).tolist()) == list(range(100))
    assert not np.array_equal(p.epoch_order(3), p.epoch_order(4))
    assert p.batches_per_epoch == 15
    assert Plan(100, 7, p.transform, drop_last=True).batches_per_epoch == 14


# ---- the pool: redo accounting ------------------------------------------------------------------
class _RacyRing:
    """A ring through which a live worker takes (and records) a new ticket at the worst
    moment for the supervisor: after it has read the claims, before it reads the counter."""

    def __init__(self, ring, live_worker):
        self._ring, self._live = ring, live_worker
        self.claims_read, self.raced = False, None

    def __getattr__(self, name):
        return getattr(self._ring, name)

    def claim(self, worker):
        self.claims_read = True
        return self._ring.claim(worker)

    @property
    def next_ticket(self):
        if self.claims_read and self.raced is None:
            self.raced = self._ring.take_ticket()
            self._ring.set_claim(self._live, self.raced + 1)
        return self._ring.next_ticket


def test_lost_tickets_exclude_tickets_taken_after_the_claims_were_read():
    """Redo accounting: a ticket a live worker takes mid-check is not 'lost' (no double fill)."""
    ring = Ring.create(4, 1, 8)
    try:
        for t in range(3):
            assert ring.take_ticket() == t
        rh.fill_slot(ring, 0)
        ring.publish(0)               # ticket 0 done; worker 0 died holding ticket 1
        ring.set_claim(1, 2 + 1)      # worker 1 (alive) holds ticket 2
        racy = _RacyRing(ring, live_worker=1)
        pool = WorkerPool(racy, Plan(10, 1, en.RandomResizedCrop((8, 8))), None, 2,
                          mode="thread")
        lost = pool._lost_tickets(0)
        assert lost == [1], f"tickets {lost} would be filled again"
        assert racy.raced in (None, 3)
    finally:
        ring.unlink()
