"""Start-up work run in a thread beside other start-up work, its result or error taken later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_background(work: Callable[[], T], name: str) -> Future[T]:
    """Run `work()` in a daemon thread now; the future holds its result or its exception.

    For work that mostly waits on other processes (reward workers importing the user's file), so
    it overlaps with what the calling thread computes meanwhile instead of delaying it."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to whoever takes the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
