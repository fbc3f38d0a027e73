"""Order-keeping parallel map with a bounded number of tasks in flight: the output of a
tokenization stage is the same for any worker count, and memory does not grow with the
input."""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[Any], R],
    items: Iterable[T],
    workers: int,
    initializer: Callable[..., None],
    initargs: tuple,
    key: Callable[[T], Any] = lambda item: item,
) -> Iterator[tuple[T, R]]:
    """``(item, fn(key(item)))`` in input order. ``workers == 1`` runs in this process;
    otherwise ``workers`` processes (each set up by ``initializer(*initargs)``) hold at most
    ``2 * workers`` items between them. Only ``key(item)`` crosses to a worker."""
    if workers == 1:
        initializer(*initargs)
        for item in items:
            yield item, fn(key(item))
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append((item, pool.apply_async(fn, (key(item),))))
            if len(pending) >= 2 * workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()
