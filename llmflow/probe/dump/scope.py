"""Which calls a step records: msprobe's ``scope`` and ``list`` options (Ascend/mstt,
``debug/accuracy_tools/msprobe/docs/02.config_introduction.md``, section 1.2), and the
forward/backward pairing of call names."""

from __future__ import annotations


def backward_name(forward: str) -> str:
    """The backward entry of a forward entry: ``Module.x.Linear.forward.0`` ->
    ``Module.x.Linear.backward.0``, ``Functional.linear.0.forward`` -> ``Functional.linear.0.backward``."""
    head, _, tail = forward.rpartition(".forward")
    return f"{head}.backward{tail}"


def _matches(item: str, name: str) -> bool:
    return name == item or name.startswith(item + ".")


class CallFilter:
    """Decides, as each call starts, whether its forward and its backward are recorded."""

    def __init__(self, scope: list[str], names: list[str]) -> None:
        self.scope = scope
        self.names = names
        self._in_range = False
        self._range_end: str | None = None
        """The call whose end closes the range: the first (outermost) call matching scope[1]."""

    def begin(self, forward: str, open_calls: list[str]) -> tuple[bool, bool]:
        """(record the forward, record the backward) of the call ``forward`` starting inside
        the module calls ``open_calls`` (outermost first)."""
        if len(self.scope) == 2:
            if not self._in_range and _matches(self.scope[0], forward):
                self._in_range = True
            if self._in_range and self._range_end is None and _matches(self.scope[1], forward):
                self._range_end = forward
            if not self._in_range:
                return False, False
        elif len(self.scope) == 1 and not any(_matches(self.scope[0], call) for call in open_calls):
            return False, False
        if not self.names:
            return True, True
        return self.listed(forward), self.listed(backward_name(forward))

    def end(self, forward: str) -> None:
        """The call ``forward`` returned."""
        if forward == self._range_end:
            self._in_range = False
            self._range_end = None

    def listed(self, name: str) -> bool:
        """Whether the ``list`` option names the call ``name`` (in full, or an API or module name in it)."""
        parts = set(name.split("."))
        return any(item == name or ("." not in item and item in parts) for item in self.names)
