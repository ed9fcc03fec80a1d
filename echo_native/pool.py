"""The supervisor of the workers: starts them, replaces those that die, stops them all.

A worker process is a fresh interpreter running
:func:`echo_native.workers.worker_main`, told its job on stdin
(:class:`WorkerProcess`); :class:`WorkerPool` starts the workers, re-issues
the tickets a dead one held (a ticket is a pure function of the plan, so its
batch is redone with identical bytes), kills one stuck on a sample past
``sample_timeout``, and gives up only on a crash loop.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from echo_native.ring import CLAIM_PENDING
from echo_native.workers import describe, run_worker

#: A sample whose read or decode has killed its worker this many times is not read
#: again: the replacements report it as a failed sample, naming it.
_DEADLY_AFTER = 2
_SPAWN_TIMEOUT_S = 60.0  # fork + exec of one worker interpreter (not its boot)


# ---- worker processes ---------------------------------------------------------------
# A worker process is a fresh interpreter running worker_main(), never a
# multiprocessing child: spawn and forkserver children run the user's __main__
# again (a training script without a main guard would build another ring in
# every worker), and fork would copy the consumer's threads and CUDA context.
# Everything a worker needs arrives on its stdin, so nothing depends on what
# the parent happened to import.

_ENTRY = "import echo_native.workers as w; w.worker_main()"

# A worker decodes on one thread.  The BLAS and OpenMP pools numpy or torch
# would start at import spin for a while before they sleep (about 0.1 s of a
# core per process for numpy's OpenBLAS), and a source calling into them would
# run one pool per worker on cores the other workers are decoding on.  So the
# pools get ECHO_NATIVE_WORKER_THREADS threads (default 1) in every worker,
# whatever the consumer's own settings are for its training.
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def worker_env():
    """The environment of a worker process: the consumer's, with the thread pools of
    :data:`THREAD_VARS` set to ``ECHO_NATIVE_WORKER_THREADS`` (default 1)."""
    n = os.environ.get("ECHO_NATIVE_WORKER_THREADS", "1")
    if not (n.isascii() and n.isdigit()) or int(n) < 1:
        raise ValueError(f"ECHO_NATIVE_WORKER_THREADS must be a positive integer (threads per "
                         f"worker for BLAS and OpenMP), got {n!r}")
    return {**os.environ, **{var: str(int(n)) for var in THREAD_VARS}}


def ship(plan, source) -> bytes:
    """The plan and the source as bytes a worker process can load.

    By value where needed (cloudpickle): a source class, or a lambda it holds,
    defined in a script, ``python -c`` or a notebook reaches the workers.
    Anything that cannot cross a process boundary is refused here, at
    construction, with what to do about it.
    """
    import cloudpickle

    try:
        return cloudpickle.dumps((plan, source), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"the source {type(source).__name__} cannot be sent to worker processes "
            f"({type(e).__name__}: {e}). Keep open files, locks, sockets and threads out of "
            f"its state (open them lazily in read(), as TarShards does), or pass "
            f"worker_mode='thread'") from None


class WorkerProcess:
    """One worker process, started on :func:`worker_main` and told its job on stdin.

    Same vocabulary as ``multiprocessing.Process`` where the pool needs it:
    ``pid``, ``exitcode`` (negative: killed by that signal), ``join``, ``kill``.
    """

    def __init__(self, ring, index, job, redo, owner_pid, stalled=None):
        # A session of its own: Ctrl-C in a terminal (or Jupyter's interrupt,
        # which signals the kernel's process group) is the consumer's to
        # handle, and must not reach a worker still importing, before it can
        # ignore SIGINT.  A worker notices its owner's death by polling.
        # The ring travels as its handle: a memfd ring's descriptor is inherited
        # (pass_fds; it is close-on-exec for every other child) and its number
        # is in the message; a named ring's name.
        handle = ring.handle()
        self._proc = subprocess.Popen([sys.executable, "-c", _ENTRY], stdin=subprocess.PIPE,
                                      env=worker_env(),
                                      start_new_session=True,
                                      pass_fds=(handle[1],) if handle[0] == "fd" else ())
        self.pid = self._proc.pid
        # sys.path first, on its own: the job may need it to unpickle.
        self._message = (pickle.dumps(list(sys.path)),
                         pickle.dumps((handle, index, list(redo), owner_pid, job,
                                       dict(stalled or {}))))

    def send(self):
        """Write the job (blocks until the new interpreter reads it)."""
        try:
            for part in self._message:
                self._proc.stdin.write(part)
            self._proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass  # it died before reading: the supervisor sees its exit code
        self._message = None

    @property
    def exitcode(self):
        return self._proc.poll()

    def is_alive(self):
        return self._proc.poll() is None

    def join(self, timeout=None):
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self):
        if self._proc.poll() is None:
            self._proc.kill()

    def close(self):
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()


# ---- the supervisor ------------------------------------------------------------------
class WorkerPool:
    """Starts the workers, replaces those that die, and stops them all on close.

    A worker dying now and then (the OOM killer, a bad library) is replaced
    for as long as the run lasts; only a crash loop, more than
    ``max_restarts`` deaths within ``restart_window`` seconds, is an error.
    """

    def __init__(self, ring, plan, source, workers, mode="process", job=None,
                 max_restarts=8, restart_window=60.0, sample_timeout=None):
        if mode not in ("process", "thread"):
            raise ValueError(f"worker mode must be 'process' or 'thread', got {mode!r}")
        self.ring, self.plan, self.source = ring, plan, source
        self.mode, self.count = mode, workers
        self.max_restarts, self.restart_window = max_restarts, restart_window
        self.restarts = 0
        self._recent = []  # (time, sample id or None) of recent deaths that count
        self._stop = threading.Event()
        self._workers = [None] * workers
        self._thread_errors = []
        self._job = ship(plan, source) if mode == "process" and job is None else job
        self.sample_timeout = sample_timeout
        self._stalled = {}     # sample id -> why replacements fail it without reading it
        self._deaths = Counter()  # sample id -> workers that died while reading it
        self._stuck = set()    # workers killed for a stalled read (not a crash)
        self._owed = [()] * workers  # the redo tickets each worker was started with
        self._dead = []        # dead workers whose tickets are not yet re-issued
        self._spawner = None   # the thread that forks the worker processes

    def start(self):
        # Start every interpreter before feeding any: they boot in parallel.
        started = [self._spawn(i, (), send=False) for i in range(self.count)]
        for p in started:
            if self.mode == "process":
                p.send()

    def _spawn(self, index, redo, send=True):
        self._owed[index] = tuple(redo)
        if self.mode == "process":
            # Linux sends the parent-death signal when the *thread* that forked a
            # child ends, so every worker is forked by the pool's own thread:
            # starting or iterating from a short-lived thread must not kill them.
            if self._spawner is None:
                self._spawner = ThreadPoolExecutor(1, "echo_native-spawner")
            p = self._spawner.submit(WorkerProcess, self.ring, index, self._job, redo,
                                     os.getpid(), self._stalled).result(_SPAWN_TIMEOUT_S)
            if send:
                p.send()
        else:
            def body():
                try:
                    run_worker(self.ring, index, self.plan, self.source, redo, stop=self._stop)
                except BaseException as e:  # surfaced by check()
                    self._thread_errors.append(e)
            p = threading.Thread(target=body, name=f"echo_native-worker-{index}", daemon=True)
            p.start()
        self._workers[index] = p
        return p

    def pids(self):
        return [w.pid for w in self._workers if self.mode == "process" and w is not None]

    def holder(self, ticket):
        """Index of the worker holding ``ticket``, or None."""
        for i in range(self.count):
            if self.ring.claim(i) == ticket + 1:
                return i
        return None

    def waiting_on(self, ticket):
        """What a consumer waiting for ``ticket`` waits on, for its timeout message:
        which worker holds it and, when that worker is inside a sample, which sample
        (named by the source: the file or URL) and for how long."""
        i = self.holder(ticket)
        if i is None:
            return "no worker has claimed it"
        reading = self.ring.reading(i)
        if reading is None:
            return f"worker {i} holds it"
        sid, seconds = reading
        return (f"worker {i} holds it and has been reading and decoding sample {sid} "
                f"({describe(self.source, sid)}) for {seconds:.0f} s")

    def check(self, consumer_ticket):
        """Replace dead workers and re-issue the tickets they held."""
        if self._thread_errors:
            raise RuntimeError("a worker thread failed") from self._thread_errors[0]
        if self.mode != "process":
            return
        self._kill_stalled()
        dead = [i for i, p in enumerate(self._workers)
                if p.exitcode is not None and i not in self._dead]
        if dead:
            self._bury(dead)
        if not self._dead:
            return
        lost = self._lost_tickets(consumer_ticket)
        if lost is None:
            return  # a live worker is mid-take: its ticket is unknown until the next check
        dead, self._dead = self._dead, []
        for n, i in enumerate(dead):
            self._spawn(i, lost[n::len(dead)])

    def _bury(self, dead):
        """Count, report and clear the words of workers found dead."""
        self.restarts += len(dead)
        now = time.monotonic()
        self._recent = [d for d in self._recent if now - d[0] < self.restart_window]
        # The sample each was reading when it died, from its words in the ring.
        during = {i: (None if self.ring.reading(i) is None else self.ring.reading(i)[0])
                  for i in dead}
        for i in dead:
            if i in self._stuck:
                continue  # replaced because a read hung: not a crash, no crash-loop count
            sid = during[i]
            if sid is not None and sid in self._stalled:
                continue  # a sample already known to kill its reader: reported as failed
            self._recent.append((now, sid))
            if sid is not None:
                self._deaths[sid] += 1
                if self._deaths[sid] >= _DEADLY_AFTER:
                    self._stalled[sid] = (
                        f"its worker died while reading or decoding it, {self._deaths[sid]} "
                        f"times (last exit code {self._workers[i].exitcode}); not read again")
        if len(self._recent) > self.max_restarts:
            codes = {i: self._workers[i].exitcode for i in dead}
            often = Counter(sid for _, sid in self._recent if sid is not None)
            named = "; ".join(f"sample {sid} ({describe(self.source, sid)}) {n} time(s)"
                              for sid, n in often.most_common(3))
            raise RuntimeError(f"echo_native workers keep dying (exit codes {codes}): "
                               f"{len(self._recent)} deaths in {self.restart_window:.0f} s, "
                               f"giving up" + (f". They died while reading {named}, of "
                                               f"{type(self.source).__name__}" if named else ""))
        for i in dead:
            self._workers[i].join(0)
            self.ring.set_claim(i, 0)
            self.ring.set_reading(i)  # else the replacement would look stalled at once
            if i in self._stuck:
                self._stuck.discard(i)
            else:
                sid = during[i]
                at = "" if sid is None else \
                    f" while reading sample {sid} ({describe(self.source, sid)})"
                warnings.warn(f"echo_native worker {i} died (exit code "
                              f"{self._workers[i].exitcode}){at}; restarting it",
                              RuntimeWarning, stacklevel=4)
        self._dead += dead

    def _kill_stalled(self):
        """Kill each worker stuck on one sample for over ``sample_timeout`` (a hung
        network mount cannot be interrupted from inside): check() replaces it, and
        the replacement reports that sample as failed instead of reading it again."""
        if not self.sample_timeout:
            return
        for i, p in enumerate(self._workers):
            if p is None or i in self._stuck or p.exitcode is not None:
                continue
            reading = self.ring.reading(i)
            if reading is not None and reading[1] > self.sample_timeout:
                sid, seconds = reading
                self._stalled[sid] = (f"reading it stalled for {seconds:.0f} s (over "
                                      f"sample_timeout={self.sample_timeout:g} s); its worker "
                                      f"was replaced")
                self._stuck.add(i)
                p.kill()
                p.join(1.0)

    def _lost_tickets(self, consumer_ticket):
        """The tickets in [consumer_ticket, next ticket) that no live worker holds or
        owes and none has published: the dead took them.  None while a live worker is
        between taking a ticket and recording it (which one it took is unknown)."""
        # Read the ticket counter first: a ticket a live worker takes after the
        # claims are read must not count as lost (it would be filled twice, the
        # second time into a slot the consumer may already have handed on).
        end = self.ring.next_ticket
        live = [i for i in range(self.count) if i not in self._dead]
        deadline = time.monotonic() + 0.5
        while any(self.ring.claim(i) == CLAIM_PENDING for i in live):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)
        held = {self.ring.claim(i) - 1 for i in live if self.ring.claim(i)}
        # A replacement owes its redo tickets before it claims them (it may not
        # have booted yet): they are held too, until they are published.
        held.update(t for i in live for t in self._owed[i])
        return [t for t in range(consumer_ticket, end)
                if t not in held and not self.ring.is_published(t)]

    def close(self, timeout=5.0):
        self._stop.set()
        self.ring.close()
        deadline = time.monotonic() + timeout
        try:
            for p in self._workers:
                if p is not None:
                    p.join(max(0.0, deadline - time.monotonic()))
        finally:
            # Also when a Ctrl-C lands in the joins above: no worker outlives close().
            for p in self._workers:
                if p is not None and self.mode == "process":
                    if p.is_alive():
                        p.kill()
                        p.join(1.0)
                    p.close()
            self._workers = [None] * self.count
            self._dead = []
            if self._spawner is not None:
                self._spawner.shutdown(wait=False)
                self._spawner = None
