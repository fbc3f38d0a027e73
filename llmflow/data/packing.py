"""Packing variable-length samples into rows of a fixed token budget.

Best fit over a bounded set of open rows: each sample goes to the open row it fills most
tightly; when none has room, a new row opens, and when too many are open the fullest one
is closed. The result depends only on the order of the samples, and memory holds at most
``max_open`` rows, so packing streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Packer(Generic[T]):
    """Collects ``(length, item)`` pairs into rows whose lengths sum to at most ``capacity``."""

    def __init__(self, capacity: int, max_open: int = 64) -> None:
        self.capacity = capacity
        self.max_open = max_open
        self._open: list[tuple[int, list[T]]] = []  # (free tokens, items), in opening order

    def add(self, length: int, item: T) -> Iterator[list[T]]:
        """Place ``item``; yields the rows this closes."""
        if not 0 < length <= self.capacity:
            raise ValueError(f"a sample of {length} tokens cannot be packed into rows of {self.capacity}")
        best = -1
        for i, (free, _) in enumerate(self._open):
            if length <= free and (best < 0 or free < self._open[best][0]):
                best = i
        if best >= 0:
            free, items = self._open[best]
            items.append(item)
            self._open[best] = (free - length, items)
            return
        if len(self._open) == self.max_open:
            fullest = min(range(len(self._open)), key=lambda i: self._open[i][0])
            yield self._open.pop(fullest)[1]
        self._open.append((self.capacity - length, [item]))

    def flush(self) -> Iterator[list[T]]:
        """Yields every open row, in the order they were opened."""
        while self._open:
            yield self._open.pop(0)[1]
