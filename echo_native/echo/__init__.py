"""Data echoing (Choi et al., arXiv 1907.05550): the echo engine, in reading order.

- :mod:`~echo_native.echo.spec`: :class:`Echo`, how often and where examples repeat;
- :mod:`~echo_native.echo.counts`: emissions per example, and the generators that
  order them (pure functions of the seed and epoch);
- :mod:`~echo_native.echo.buffer`: the shuffle buffer's books, and batch echo's window;
- :mod:`~echo_native.echo.auto`: ``echo="auto"``, e from measured rates;
- :mod:`~echo_native.echo.ledger`: first emissions, for an exact resume;
- :mod:`~echo_native.echo.state`: a stage's state, its upstream's nested in it, and
  ``merge_states`` of a job's stage states;
- :mod:`~echo_native.echo.upstream`: the protocol of whatever makes fresh batches;
- :mod:`~echo_native.echo.stage`: the steps every stage shares;
- :mod:`~echo_native.echo.stages`: the stages, one per placement, and ``make_stage``;
- :mod:`~echo_native.echo.images`: how ring examples are stored and re-augmented.
"""
from echo_native.echo.spec import PLACEMENTS, Echo
from echo_native.echo.counts import batch_rng, counts_from, echo_counts, echo_draws, shuffle_rng
from echo_native.echo.buffer import BatchWindow, ExampleBuffer, buffer_bytes
from echo_native.echo.auto import AutoEcho

__all__ = ["AutoEcho", "BatchWindow", "Echo", "ExampleBuffer", "PLACEMENTS", "batch_rng",
           "buffer_bytes", "counts_from", "echo_counts", "echo_draws", "shuffle_rng"]
