"""Pydantic validation errors as one line: each problem as "where: what (got value)"."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

Location = tuple[int | str, ...]


def dotted(location: Location) -> str:
    """A field's location as dotted keys (``optim.lr``), as configs and overrides name it."""
    return ".".join(str(part) for part in location)


def one_line(error: ValidationError, name: Callable[[Location], str] = dotted) -> str:
    """Every problem of ``error``, "; "-separated: the field (``name`` of its location; none for
    the model as a whole), the message and the value given (left out when it is missing or the
    problem concerns several fields)."""
    problems = []
    for item in error.errors():
        value_error = item["type"] == "value_error"
        what = str(item["ctx"]["error"]) if value_error and "error" in item.get("ctx", {}) else item["msg"]
        got = "" if value_error or item["type"] == "missing" else f" (got {item['input']!r})"
        where = name(item["loc"])
        problems.append(f"{where}: {what}{got}" if where else f"{what}{got}")
    return "; ".join(problems)
