"""A child process that ends with the process that started it."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
from typing import Final

EXIT_PARENT_GONE: Final = 3
"""A child's exit status when the process that started it has ended (:func:`exit_with_parent`)."""
_watching = False  # (this process's watch is running)


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
