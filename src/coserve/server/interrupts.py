"""Ctrl-C and SIGTERM in the command-line tools: a clean stop with one line, never a traceback.

Outside a fine-tuning loop, SIGINT raises ``KeyboardInterrupt`` where the main thread is (Python's
default) and SIGTERM raises :class:`Terminated`, its subclass, the same way (:func:`terminate_raises`):
the ``finally`` blocks on the way out stop the trainer and write what they write, and the
command's caller prints one line and exits with ``128 + the signal's number``. Inside one
(:func:`stop_requests`), either only asks the loop to stop at the next step boundary, where the
run can export its adapter and write a checkpoint; a second one raises, for a stop that hangs.
The children (trainer, spare, dataset reader) ignore both: their parent stops them
(:mod:`coserve.parent_watch`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where it came (as Ctrl-C raises KeyboardInterrupt)."""


def signal_of(stop: KeyboardInterrupt) -> signal.Signals:
    """The signal that raised ``stop``: SIGTERM for :class:`Terminated`, else SIGINT."""
    return signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """While the block runs (in the main thread; elsewhere nothing changes): SIGTERM raises
    :class:`Terminated` instead of ending the process at once (no ``finally`` run: a trainer left
    to its parent watch, no adapter written, multiprocessing's "leaked semaphore" warning)."""
    if not _main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_requests() -> Iterator[list[signal.Signals]]:
    """While the block runs (in the main thread; elsewhere nothing changes): the first SIGINT or
    SIGTERM is appended to the list yielded, for the loop to stop at its next step boundary,
    rather than raised inside an engine step (a task half submitted, a step half logged); a
    second one raises (``KeyboardInterrupt``, :class:`Terminated`)."""
    asked: list[signal.Signals] = []
    if not _main_thread():
        yield asked
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if asked:
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        asked.append(signal.Signals(signum))

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield asked
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
