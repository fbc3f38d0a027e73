"""The dump configuration: msprobe's ``config.json``, read as msprobe documents it.

Keys and values follow msprobe's configuration reference (Ascend/mstt,
``debug/accuracy_tools/msprobe/docs/02.config_introduction.md``), so a config written for
msprobe works here. Of msprobe's tasks llmflow runs ``statistics`` and ``tensor``; the
sections of the other tasks are accepted (msprobe's stock config.json carries them all)
and not used.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DataMode = Literal["all", "forward", "backward", "input", "output"]

_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def expand_ranges(values: list[int | str], key: str) -> frozenset[int]:
    """The numbers that ``[0, 2, "4-6"]`` lists (0, 2, 4, 5, 6); ``key`` names the option in errors."""
    numbers: set[int] = set()
    for i, value in enumerate(values):
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"{key}[{i}]: {value} is negative")
            numbers.add(value)
            continue
        match = _RANGE.fullmatch(value) if isinstance(value, str) else None
        first, last = (int(match[1]), int(match[2] or match[1])) if match else (1, 0)
        if first > last:
            raise ValueError(f"{key}[{i}]: {value!r} is neither a number nor a range 'a-b' with a <= b")
        numbers.update(range(first, last + 1))
    return frozenset(numbers)


class TaskSection(BaseModel):
    """What a task dumps: which calls (``scope``, ``list``) and which of their data (``data_mode``)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", populate_by_name=True)

    scope: list[str] = Field(default_factory=list)
    """Two names bounding a range of calls, in execution order, both included (a name
    matches a call whose name equals it or starts with it followed by a dot, e.g.
    "Module.model.layers.1"); or, at level mix, one module name: the calls inside that
    module. Empty: every call."""
    names: list[str] = Field(default_factory=list, alias="list")
    """Calls to dump: full names ("Functional.linear.3.forward", "Module.model.norm.RMSNorm.backward.0")
    or an API or module name matching every call of it ("linear", "down_proj"). Empty: every call."""
    data_mode: list[DataMode] = Field(default_factory=lambda: ["all"])
    """Which data of each call: "all", or any of "forward", "backward", "input", "output"
    (a record is kept when its direction or its side is listed)."""

    @field_validator("scope")
    @classmethod
    def _scope_size(cls, scope: list[str]) -> list[str]:
        if len(scope) > 2:
            raise ValueError(f"scope: expected at most two names (a range), got {len(scope)}")
        return scope

    @field_validator("data_mode")
    @classmethod
    def _all_alone(cls, modes: list[str]) -> list[str]:
        if not modes:
            raise ValueError('data_mode: expected "all" or some of "forward", "backward", "input", "output"')
        if "all" in modes and len(modes) > 1:
            raise ValueError(f'data_mode: "all" cannot be combined with other modes, got {modes}')
        return modes


class StatisticsSection(TaskSection):
    """Options of the statistics task."""

    summary_mode: Literal["statistics", "md5"] = "statistics"
    """statistics: Max, Min, Mean and Norm of every tensor; md5: also its CRC-32 (msprobe's
    "md5" field), for bitwise comparisons."""


class TensorSection(TaskSection):
    """Options of the tensor task."""

    file_format: Literal["npy", "bin"] | None = None
    """MindSpore's tensor file format in msprobe; PyTorch tensors are always saved as .pt."""


class ProbeConfig(BaseModel):
    """A dump configuration in msprobe's config.json schema."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    task: Literal["statistics", "tensor"] = "statistics"
    """statistics: dtype, shape and statistics of every tensor (dump.json only); tensor: the
    same plus every tensor saved under dump_tensor_data/."""
    dump_path: Path
    """Root of the dump: {dump_path}/step{N}/rank{R}/dump.json."""
    rank: list[int | str] = Field(default_factory=list)
    """Ranks that dump, as numbers or ranges ("4-6"); empty: every rank."""
    step: list[int | str] = Field(default_factory=list)
    """Steps to dump, counted from 0 as msprobe counts them, as numbers or ranges ("4-6");
    empty: every step."""
    level: Literal["L0", "L1", "mix"] = "L1"
    """L0: modules (forward/backward hooks); L1: torch APIs (a TorchFunctionMode); mix: both."""
    enable_dataloader: bool = False
    """msprobe's automatic step control; llmflow's training loop marks steps itself, so it must be false."""
    statistics: StatisticsSection = StatisticsSection()
    """Options when task is statistics."""
    tensor: TensorSection = TensorSection()
    """Options when task is tensor."""
    overflow_check: dict[str, Any] | None = None
    """Section of a task llmflow does not run (accepted so msprobe's stock config.json loads)."""
    run_ut: dict[str, Any] | None = None
    """Section of a task llmflow does not run (accepted so msprobe's stock config.json loads)."""
    grad_probe: dict[str, Any] | None = None
    """Section of a task llmflow does not run (accepted so msprobe's stock config.json loads)."""
    free_benchmark: dict[str, Any] | None = None
    """Section of a task llmflow does not run (accepted so msprobe's stock config.json loads)."""

    @field_validator("rank", "step")
    @classmethod
    def _ranges(cls, values: list[int | str], info) -> list[int | str]:
        expand_ranges(values, info.field_name)
        return values

    @field_validator("enable_dataloader")
    @classmethod
    def _no_dataloader(cls, value: bool) -> bool:
        if value:
            raise ValueError("enable_dataloader: llmflow marks training steps itself; set it to false")
        return value

    @cached_property
    def steps(self) -> frozenset[int]:
        return expand_ranges(self.step, "step")

    @cached_property
    def ranks(self) -> frozenset[int]:
        return expand_ranges(self.rank, "rank")

    @property
    def section(self) -> TaskSection:
        """The options of this task."""
        return self.statistics if self.task == "statistics" else self.tensor

    @property
    def md5(self) -> bool:
        return self.task == "statistics" and self.statistics.summary_mode == "md5"

    def dumps(self, step: int, rank: int) -> bool:
        """Whether ``rank`` dumps ``step``."""
        return (not self.steps or step in self.steps) and (not self.ranks or rank in self.ranks)


def load_probe_config(path: str | Path) -> ProbeConfig:
    """The config in the JSON file ``path``; errors name the file and the offending keys."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"probe config {path}: no such file")
    try:
        tree = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"probe config {path}: not valid JSON ({e})") from None
    try:
        return ProbeConfig.model_validate(tree)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"probe config {path}: {problems}") from None
