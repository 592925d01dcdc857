"""A child process that ends with the process that started it, and leaves Ctrl-C and SIGTERM to it.

A terminal's Ctrl-C goes to every process of its foreground group, a supervisor's SIGTERM often
to every process of the service: to a server or ``coserve finetune`` and to its children (the
trainer, a spare trainer interpreter, the dataset reader) at once. The children ignore both
(:func:`leave_signals_to_parent`, started with them held: :func:`signals_held`), so that the
parent decides how the run stops (an adapter exported, a checkpoint written) and stops them
itself, rather than each child dying with a KeyboardInterrupt traceback of its own. They still
end with the parent (:func:`exit_with_parent`) and when it kills them; at its exit it kills
those still running (:func:`end_at_exit`), since multiprocessing's exit handler ends daemonic
children with SIGTERM and then waits for them.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import weakref
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Final

EXIT_PARENT_GONE: Final = 3
"""A child's exit status when the process that started it has ended (:func:`exit_with_parent`)."""
_watching = False  # (this process's watch is running)
PARENT_SIGNALS: Final = frozenset({signal.SIGINT, signal.SIGTERM})
"""What a child leaves to the process that started it (:func:`leave_signals_to_parent`)."""


def exit_with_parent() -> None:
    """In a process started by multiprocessing: end it as soon as the process that started it ends.
    A server killed outright (SIGKILL, the OOM killer: no exit handlers, which end daemonic
    children) would otherwise leave its children blocked for ever on their queues (a trainer also
    on a cleared grant, holding its share of the GPU's memory against the next server). A thread
    waits on the parent's sentinel (no polling) and calls ``os._exit``. Nothing where there is no
    such parent, or where one watches already (a spare that became a trainer)."""
    global _watching
    parent = multiprocessing.parent_process()
    if parent is None or _watching:
        return
    _watching = True

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="coserve-parent-watch", daemon=True).start()


def leave_signals_to_parent() -> None:
    """In a child (its main thread): ignore SIGINT and SIGTERM, and take them in again where the
    child started with them held (:func:`signals_held`: one that came during its start is
    dropped). The parent stops it (a message on its queue, or SIGKILL), or its end does
    (:func:`exit_with_parent`)."""
    for sig in PARENT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PARENT_SIGNALS)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Around a child's start (any thread of the parent): SIGINT and SIGTERM blocked in this
    thread, so that the child starts with them blocked (a thread's signal mask passes through
    fork and exec) until its :func:`leave_signals_to_parent`: a Ctrl-C during its interpreter's
    start and imports (seconds: ``import torch``) is not a KeyboardInterrupt there. The parent's
    other threads take such a signal meanwhile (its handlers run in its main thread, as ever);
    where this is the only thread, the signal waits until the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PARENT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_ending: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


def end_at_exit(proc: BaseProcess) -> None:
    """Kill ``proc`` (a child that ignores SIGTERM: :func:`leave_signals_to_parent`) at this
    process's exit if it still runs then (one that was not stopped: an error on the way)."""
    _ending.add(proc)


def _kill_remaining() -> None:
    for proc in list(_ending):
        with contextlib.suppress(AssertionError, ValueError):  # (another process's child, or closed)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


# NOTE: registered after multiprocessing's own exit handler (imported above), so it runs first:
# that one ends daemonic children with SIGTERM and waits for them, for ever for one that ignores it.
atexit.register(_kill_remaining)
