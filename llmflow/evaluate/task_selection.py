"""What both kinds of task group (log-likelihood and generative) check before any work: the
tasks asked for are the group's, and the group's data directory holds one directory per task."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from llmflow.evaluate.questions import BenchmarkDataError


class NamedTask(Protocol):
    name: str


T = TypeVar("T", bound=NamedTask)


def select_tasks(title: str, tasks: Sequence[T], names: list[str] | None) -> list[T]:
    """The ``tasks`` named in ``names`` (all when empty), in their order; an error naming the
    unknown ones and every task otherwise."""
    known = [task.name for task in tasks]
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"{title}: no tasks {unknown}; its tasks are {known}")
    return [task for task in tasks if not names or task.name in names]


def check_task_directories(title: str, root: Path, tasks: Sequence[T], directory: Callable[[T], Path],
                           named: str) -> None:
    """Raise, naming the tasks without a directory and those with one, when any of ``tasks``
    has no ``directory(task)`` (a directory per task, ``named`` after its dataset or subtask)."""
    missing = [task.name for task in tasks if not directory(task).is_dir()]
    if missing:
        present = [task.name for task in tasks if task.name not in missing]
        raise BenchmarkDataError(
            f"{title} data {root}: no directory for tasks {missing} (expected one per task, named as its {named}, "
            f"e.g. {directory(tasks[0])}); evaluate the tasks it has with tasks={present}")
