"""What Loader, EchoRing and EchoLoader share as consumers of a stream that must not be
read twice: one iteration at a time, ``with`` blocks, and no pickling."""
from __future__ import annotations

import contextlib
import threading

NOT_PICKLABLE = ("a {0} cannot be pickled: it owns worker processes and shared memory "
                 "that only its own process may use. Pickle (or send) its source and specs "
                 "instead, and build a new {0} from them where it is needed")


class IterationGuard:
    """One live iteration at a time, over a stream that must not be read twice.

    Iterating again takes over from an earlier iterator (whose next ``next()``
    raises instead of reading on), as leaving a ``for`` loop early and starting
    another does; ``close()`` ends every iterator taken before it; and a
    ``next()`` while another thread is inside one is refused, never served
    twice.  Each step holds a lock only while the stream moves, not while the
    consumer works on its batch.
    """

    def __init__(self, owner):
        self._owner = owner
        self._lock = threading.Lock()
        self._token = None      # the live iterator's
        self._source = None     # its generator of batches, to close on take-over
        self._deferred = None   # what stop() left for the stepping thread to run

    def iterate(self, make):
        """Batches of the generator ``make()`` returns, guarded."""
        token = object()
        with self._step():
            self._close_source()
            self._token, self._source = token, make()
        source = self._source
        try:
            while True:
                with self._step():
                    if self._token is not token:
                        raise RuntimeError(
                            f"this {self._owner} iterator was superseded: the {self._owner} "
                            f"was closed, or iterated again, since it was taken (one "
                            f"iteration at a time; start a new `for` loop over it)")
                    try:
                        batch = next(source)
                    except StopIteration:
                        self._token = self._source = None
                        return
                yield batch
        finally:
            # Left early (break, an exception): the stream stops here, and a later
            # iteration continues from it.  (Only this generator can hold the lock
            # for its own token; the timeout is a guard, not a wait.)
            if self._token is token and self._lock.acquire(timeout=60):
                try:
                    self._close_source()
                    self._token = None
                finally:
                    self._lock.release()
            self.run_deferred()

    def stop(self, then=None):
        """End every live iterator, from any thread (a watchdog's ``close()``): True when
        done here (as :meth:`end`); False when another thread is inside a ``next()``
        (blocked in the stream): its iterator is ended all the same, and that thread,
        once its step returns, delivers what it took and raises at its next ``next()``,
        running ``then`` (the rest of the owner's close) as its iteration ends."""
        if self._lock.acquire(blocking=False):
            try:
                self._close_source()
                self._token = None
            finally:
                self._lock.release()
            return True
        self._deferred = then
        self._token = None
        return False

    def run_deferred(self):
        then, self._deferred = self._deferred, None
        if then is not None:
            then()

    def busy(self):
        """Whether a thread is inside a ``next()`` now."""
        return self._lock.locked()

    def end(self):
        """End every live iterator (close())."""
        with self._step():
            self._close_source()
            self._token = None

    def _close_source(self):
        source, self._source = self._source, None
        if source is not None:
            source.close()

    @contextlib.contextmanager
    def _step(self):
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"this {self._owner} is being iterated by another thread: one "
                               f"thread at a time may take its batches (give each thread its "
                               f"own {self._owner}, or hand batches over through a queue)")
        try:
            yield
        finally:
            self._lock.release()


class Started:
    """``with x:`` starts ``x`` (``x.start()``) and closes it at the end, however the
    block ends."""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
