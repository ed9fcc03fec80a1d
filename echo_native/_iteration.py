"""What Loader, EchoRing and EchoLoader share as consumers of a stream that must not be
read twice: one iteration at a time, ``with`` blocks, and no pickling."""
from __future__ import annotations

import contextlib
import os
import signal
import threading

NOT_PICKLABLE = ("a {0} cannot be pickled: it owns worker processes and shared memory "
                 "that only its own process may use. Pickle (or send) its source and specs "
                 "instead, and build a new {0} from them where it is needed")


class _Sigint:
    """The state of the SIGINT handler :func:`deferred_interrupts` installs."""

    installed = False   # our handler is in place (the outermost block put it there)
    caught = False      # a Ctrl-C came while it was, and is held
    open = 0            # inside an interruptible() wait: a Ctrl-C raises at once
    second = 0          # inside a second_press() wait: a second Ctrl-C raises at once
    pressed = False     # a Ctrl-C came during that wait


_OURS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
         os.path.abspath(contextlib.__file__))


def _foreign(frame):
    """Whether the interrupted ``frame`` is the wrapped loader's (or deeper), not ours:
    a batch it returned has not reached our frames yet, so raising there takes none."""
    name = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    return not (name.startswith(_OURS[0]) or name == _OURS[1])


def _hold(signum, frame):
    if _Sigint.open or (_Sigint.second and _Sigint.pressed and _foreign(frame)):
        _Sigint.caught = _Sigint.pressed = False
        raise KeyboardInterrupt
    _Sigint.caught = True
    _Sigint.pressed = bool(_Sigint.second)


class deferred_interrupts:
    """Hold a Ctrl-C until the block is done.

    The block moves batches or examples between an upstream, an echo buffer and
    the consumer; a KeyboardInterrupt in its middle would lose one or hand it out
    twice, and a training loop may catch the interrupt and iterate on.  Inside
    the block, an :class:`interruptible` wait (for the upstream's next batch)
    still raises at once, so a stuck upstream can be interrupted.  Only the main
    thread receives KeyboardInterrupt, and only there can the handler be
    swapped; a handler the user installed is left alone.  Blocks nest: an inner
    one holds a Ctrl-C even inside an outer interruptible wait.

    A class, not a generator: no signal is handled between ``__enter__`` changing
    the books and the block's start (a generator's ``__enter__`` runs a call after
    its body yields, where an interrupt would skip ``__exit__``).
    """

    __slots__ = ("_mode", "_outer")

    def __enter__(self):
        self._mode = None
        if threading.current_thread() is not threading.main_thread():
            return self
        if _Sigint.installed:
            self._outer, _Sigint.open = _Sigint.open, 0
            self._mode = "nested"
            return self
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return self
        _Sigint.caught, _Sigint.open = False, 0
        # Marked installed before the handler is (and not after it is gone): a Ctrl-C
        # between the two finds either our handler, which holds it, or the default
        # one, which raises; the books never say installed while the default handler
        # is in place.
        _Sigint.installed = True
        signal.signal(signal.SIGINT, _hold)
        self._mode = "top"
        return self

    def __exit__(self, *exc):
        if self._mode == "nested":
            _Sigint.open = self._outer
            if self._outer and _Sigint.caught:   # back in an interruptible wait
                _Sigint.caught = False
                raise KeyboardInterrupt
        elif self._mode == "top":
            _Sigint.installed = False
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if _Sigint.caught:
                _Sigint.caught = False
                raise KeyboardInterrupt
        return False


class interruptible:
    """A wait inside :class:`deferred_interrupts` (for the upstream's next batch) that a
    Ctrl-C ends at once, as it would outside: nothing has been taken yet.  (A Ctrl-C
    at the start of ``__exit__`` would skip its decrement: where that matters, count
    in the caller's frame with try/finally, as :meth:`Stage.take` does.)"""

    __slots__ = ("_on",)

    def __enter__(self):
        self._on = _Sigint.installed and \
            threading.current_thread() is threading.main_thread()
        if self._on:
            if _Sigint.caught:
                _Sigint.caught = False
                self._on = False
                raise KeyboardInterrupt
            _Sigint.open += 1
        return self

    def __exit__(self, *exc):
        if self._on:
            _Sigint.open -= 1
        return False


class second_press:
    """Inside :class:`deferred_interrupts`, a wait in code that a KeyboardInterrupt would
    break for good (a wrapped generator dies of one): the first Ctrl-C is held until
    the wait is over, a second one raises at once (a stuck loader can still be
    stopped), but only inside the code waited on: once its batch is back in our
    frames, it is held like the first."""

    __slots__ = ()

    def __enter__(self):
        _Sigint.pressed = False   # one held from before the wait is not the first press
        _Sigint.second += 1
        return self

    def __exit__(self, *exc):
        _Sigint.second -= 1
        _Sigint.pressed = False
        return False


class IterationGuard:
    """One live iteration at a time, over a stream that must not be read twice.

    Iterating again takes over from an earlier iterator (whose next ``next()``
    raises instead of reading on), as leaving a ``for`` loop early and starting
    another does; ``close()`` ends every iterator taken before it; and a
    ``next()`` while another thread is inside one is refused, never served
    twice.  Each step holds a lock only while the stream moves, not while the
    consumer works on its batch.
    """

    def __init__(self, owner, hold_interrupts=False):
        self._owner = owner
        # Hold a Ctrl-C while a step moves a batch out of the source (but for the
        # source's interruptible() waits): a caught Ctrl-C then neither loses nor repeats
        # a batch.  For sources whose waits are marked so (the echo stages' takes).
        self.hold_interrupts = hold_interrupts
        self._lock = threading.Lock()
        self._token = None      # the live iterator's
        self._source = None     # its generator of batches, to close on take-over
        self._deferred = None   # what stop() left for the stepping thread to run
        # A batch taken from the source and not yet handed to the consumer (a Ctrl-C came
        # between the two): the next iteration hands it out first.
        self._ready = None
        self._handed = False    # _ready reached the consumer

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
                    if self._ready is None or self._handed:
                        # A Ctrl-C while the source moves a batch (but for its waits on
                        # the upstream) is held (by _step) until the batch is in _ready.
                        self._ready, self._handed = None, False
                        try:
                            self._ready = next(source)
                        except StopIteration:
                            self._token = self._source = None
                            return
                # No signal is handled between this store and the yield (no call, no
                # jump back): _handed is True exactly when the consumer has the batch.
                self._handed = True
                try:
                    yield self._ready
                except BaseException:
                    self._ready = None   # raised at the yield: the consumer had it
                    raise
                self._ready = None
        finally:
            # Left early (break, an exception): the stream stops here, and a later
            # iteration continues from it.  (Only this generator can hold the lock
            # for its own token; the timeout is a guard, not a wait.)
            with self._held():
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
        with self._held():
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
        """End every live iterator (close(), a new stream position)."""
        with self._step():
            self._close_source()
            self._token = self._ready = None

    def _close_source(self):
        source, self._source = self._source, None
        if source is not None:
            source.close()

    @contextlib.contextmanager
    def _step(self):
        # Holding interrupts, a Ctrl-C can land neither between the lock's acquire and
        # the try that releases it (the lock would stay held: "being iterated by another
        # thread" forever) nor anywhere else in the step but its interruptible waits.
        with self._held():
            if not self._lock.acquire(blocking=False):
                raise RuntimeError(f"this {self._owner} is being iterated by another thread: "
                                   f"one thread at a time may take its batches (give each "
                                   f"thread its own {self._owner}, or hand batches over "
                                   f"through a queue)")
            try:
                yield
            finally:
                self._lock.release()

    def _held(self):
        return deferred_interrupts() if self.hold_interrupts else contextlib.nullcontext()


class Started:
    """``with x:`` starts ``x`` (``x.start()``) and closes it at the end, however the
    block ends."""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
