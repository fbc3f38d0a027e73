"""Put the dumps of a pipeline-parallel run's stages together into one dump of the whole
model, so that it compares with a run of another pipeline layout (pp=2 against pp=1).

Each rank dumps the stages it holds, under the whole model's module names, with its own call
counters; its layout.json (``llmflow/probe/dump/dumper.py``) says which pipeline stages it
held, its pipeline and tensor-parallel groups, and which numbers each forward call of a
stage (one per micro-batch) took. A run is put together as follows:

- its ranks: the pipeline group of its first rank, each with its tensor-parallel group
  (whose shards ``merge.py`` puts together first; other data-parallel replicas hold other
  data and are not read);
- a module held by one stage keeps its records and its name: every layout numbers its calls
  alike;
- a module that several stages call (the decoder ``model``, which every stage runs over its
  own layers) makes one record per micro-batch: the first stage's inputs and parameters and
  the last stage's outputs (backward: the last stage's output gradients and the first
  stage's input gradients). Each stage's output must be the next stage's input (the pipeline
  sends it as is; where tensor-parallel shards were put together, to float rounding): where
  it is not, the record's outputs are flagged;
- a parameter gradient recorded by several stages (the tied embedding: the first stage's
  embedding and the last stage's output projection) is the sum of the stages' parts, as the
  training adds them up: summed from the saved tensors in tensor mode, left uncompared with
  the reason otherwise (the statistics of parts do not give the sum's);
- API calls (Functional.linear.N, ...) are numbered per rank, so they are matched by where
  they happen instead: the micro-batch, the API, the call site (the innermost frame of
  stack.json: file name, function and source line) and their order among the calls of that
  API at that site in the micro-batch, counting the stages in order. A stage that repeats a
  call an earlier stage made at the same site (each stage computes the rotary tables) makes
  calls without a counterpart in a run of fewer stages; where they match nothing they are
  left uncompared with that reason. The calls a rank makes outside
  the stages' forward (the training loop's and the pipeline schedule's own tensor work:
  batching, loss scaling; API calls a backward pass makes) differ between layouts and are
  left uncompared with the reason;
- names: when one side ran as one stage its names are kept, else the bench's calls are
  numbered in the order below; the other side's calls take the names of the calls they
  match, and calls without a match are numbered after every number in use.
  ``merged_names.json`` in the output says which rank, entry and stage every merged entry
  came from;
- order: micro-batch by micro-batch, the forward records stage after stage, then the
  backward records from the last stage to the first, each stage's in its own order.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmflow.probe.compare.merge import merge_ranks
from llmflow.probe.compare.reading import (
    UNMATCHED,
    WARNING,
    Leaf,
    RankDump,
    RankLayout,
    load_tensor,
    read_layout,
    read_rank,
)

_API = re.compile(r"^(?P<key>(?!Module\.).+)\.(?P<n>\d+)\.(?P<dir>forward|backward)$")
_MODULE = re.compile(r"^(?P<key>Module\..+\.)(?P<dir>forward|backward)\.(?P<n>\d+)$")
_FRAME = re.compile(r"^File (?P<path>.*), line \d+, in (?P<func>.*?), \n(?P<source>.*)$", re.DOTALL)
_STATS = ("Max", "Min", "Mean", "Norm")

OUTSIDE = ("made outside the forward of the model's stages (by the training loop, the pipeline schedule or a backward "
           "pass): runs of different layouts make different calls there")
REPEATED = ("repeats at this stage a call an earlier stage made at the same place (each stage computes it for its "
            "own layers): no counterpart in a run of fewer stages")
SHARED_GRADIENT = ("the gradient of a weight that pipeline stages {stages} share (tied embeddings) is the sum of "
                   "their parts: {why}")


@dataclass
class Entry:
    """One dump.json entry of a rank, placed in the whole model."""

    name: str
    """Its name in the rank's dump.json."""
    kind: str
    """api, module, or other (parameters_grad, unparsed names)."""
    key: str | None
    """The dumper's counter: the API ("Functional.linear") or module prefix ("Module.model.norm.RMSNorm.")."""
    number: int | None
    backward: bool
    stage: int
    micro: int | None
    """The micro-batch (the stage's forward call) it belongs to; None outside the stages' calls."""
    order: tuple
    """Its place in the whole model's order: (micro-batch, forward 0 or backward 1, stage
    (negated in backward), position in the rank's dump)."""
    site: tuple[str, str, str] | None = None
    """An API forward call's call site (``site``)."""
    anchor: tuple | None = None
    """An API forward call's place in the whole model: (micro-batch, API, site, order)."""
    repeat: bool = False
    """An API forward call that an earlier stage made at the same site in the micro-batch."""
    merged: str | None = None
    """Its name in the whole model's dump."""


@dataclass
class Side:
    """One run's ranks, placed: the stages, each rank's entries."""

    label: str
    ranks: list[tuple[str, Path, RankLayout, list[str]]]
    """(rank folder, its path, its layout, the rank folders of its tensor-parallel group), one per pipeline rank."""
    dumps: dict[str, RankDump] = field(default_factory=dict)
    entries: dict[str, list[Entry]] = field(default_factory=dict)
    """Rank folder -> its entries, in its dump's order."""
    split: set[str] = field(default_factory=set)
    """Module prefixes that several stages call."""

    @property
    def num_stages(self) -> int:
        return self.ranks[0][2].num_stages

    @property
    def tp(self) -> int:
        return len(self.ranks[0][3])

    @property
    def name(self) -> str:
        numbers = sorted(int(n.removeprefix("rank")) for _, _, _, group in self.ranks for n in group
                         if n.removeprefix("rank").isdigit())
        if len(numbers) < 2:
            return self.ranks[0][0]
        if numbers == list(range(numbers[0], numbers[-1] + 1)):
            return f"rank{numbers[0]}-{numbers[-1]}"
        return "rank" + "_".join(map(str, numbers))


def is_pipelined(layouts: list[RankLayout | None]) -> bool:
    return any(layout is not None and layout.num_stages > 1 for layout in layouts)


def place(label: str, dirs: dict[str, Path]) -> Side:
    """The ranks of ``dirs`` (a step folder's rank folders) that make one whole model."""
    names = list(dirs)
    first = read_layout(dirs[names[0]])
    if first is None:
        raise ValueError(f"{label}: {dirs[names[0]]} has no layout.json, which says how a pipeline run's ranks are laid "
                         "out: dump both runs with this llmflow")
    if first.cp_group is not None and len(first.cp_group) > 1:
        raise ValueError(f"{label}: {names[0]} holds a context-parallel group {first.cp_group} beside pipeline stages: the "
                         "stages of a run with cp are not put together; compare it rank by rank with a run of the same layout")
    pipeline = first.pipeline_group or ([first.rank] if first.rank is not None else [None])
    ranks = []
    for rank in pipeline:
        name = names[0] if rank is None else f"rank{rank}"
        if name not in dirs:
            raise ValueError(f"{label}: the pipeline group {pipeline} needs the dump of {name}")
        layout = read_layout(dirs[name]) if name != names[0] else first
        if layout is None:
            raise ValueError(f"{label}: {dirs[name]} has no layout.json")
        group = [f"rank{r}" for r in layout.tp_group] if layout.tp_group else [name]
        missing = [g for g in group if g not in dirs]
        if missing:
            raise ValueError(f"{label}: {name}'s tensor-parallel group {layout.tp_group} needs the dumps of {missing}")
        ranks.append((name, dirs[name], layout, group))
    held = sorted(s for _, _, layout, _ in ranks for s in layout.stages if s is not None)
    if held != list(range(first.num_stages)):
        raise ValueError(f"{label}: the ranks {[r[0] for r in ranks]} hold stages {held}, not the {first.num_stages} "
                         "stages of the model")
    side = Side(label, ranks)
    for name, path, layout, _ in ranks:
        side.dumps[name] = read_rank(path)
        side.entries[name] = _entries(side.dumps[name], layout)
    callers = defaultdict(set)
    for entries in side.entries.values():
        for entry in entries:
            if entry.kind == "module" and entry.micro is not None:
                callers[entry.key].add(entry.stage)
    side.split = {key for key, stages in callers.items() if len(stages) > 1}
    _anchor(side)
    return side


def _parse(name: str) -> tuple[str, str | None, int | None, bool]:
    """(kind, counter key, number, backward) of a dump.json entry name."""
    if ".parameters_grad" in name:
        return "other", None, None, True
    match = _MODULE.match(name) or _API.match(name)
    if match is None:
        return "other", None, None, False
    kind = "module" if name.startswith("Module.") else "api"
    return kind, match["key"], int(match["n"]), match["dir"] == "backward"


def site(stack: list[str] | None) -> tuple[str, str, str]:
    """The call site of a call: file name, function and source of the innermost frame of its
    stack (paths differ between machines, line numbers between versions)."""
    match = _FRAME.match(stack[0]) if stack else None
    if match is None:
        return "", "", ""
    return Path(match["path"]).name, match["func"], match["source"].strip()


def _entries(dump: RankDump, layout: RankLayout) -> list[Entry]:
    """The entries of a rank's dump, each given its stage, micro-batch and place in the order."""
    spans: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    calls: Counter[int] = Counter()
    for call in layout.calls:
        stage = call["stage"]
        for key, (first, end) in call["counts"].items():
            spans[key].append((first, end, stage, calls[stage]))
        calls[stage] += 1
    held = [s for s in layout.stages if s is not None] or [0]
    micro, phase, stage = None, 0, min(held)
    entries = []
    for position, (name, group) in enumerate(itertools.groupby(dump.leaves, key=lambda leaf: leaf.entry)):
        kind, key, number, backward = _parse(name)
        span = next(((s, m) for first, end, s, m in spans.get(key, ()) if first <= number < end), None) \
            if key is not None else None
        if span is not None:
            (stage, micro), phase = span, int(backward)
            entry_micro = micro
        else:
            entry_micro = None  # outside the stages' calls: placed after what precedes it
        order = (-1 if micro is None else micro, phase, -stage if phase else stage, position)
        entries.append(Entry(name, kind, key, number, backward, stage, entry_micro, order,
                             site(dump.stacks.get(name)) if kind == "api" and not backward else None))
    return entries


def outside_calls(dump: RankDump, layout: RankLayout) -> set[str]:
    """The entries of the API calls a rank made outside the forward of the modules it dumped
    (the training loop's own work), forward and backward."""
    return {entry.name for entry in _entries(dump, layout) if entry.kind == "api" and entry.micro is None}


def _anchor(side: Side) -> None:
    """Give every API forward call in a stage its anchor: (micro-batch, API, site, order among
    the calls of that API at that site in the micro-batch, the stages counted in order)."""
    forward = sorted((entry for entries in side.entries.values() for entry in entries
                      if entry.kind == "api" and not entry.backward and entry.micro is not None),
                     key=lambda e: (e.stage, e.micro, e.number))
    seen: Counter[tuple] = Counter()
    first_stage: dict[tuple, int] = {}
    for entry in forward:
        where = (entry.micro, entry.key, entry.site)
        entry.anchor = (*where, seen[where])
        entry.repeat = first_stage.setdefault(where, entry.stage) != entry.stage
        seen[where] += 1


# --- names ---------------------------------------------------------------------------------------------


def name_entries(target: Side, bench: Side) -> None:
    """Name every entry of both runs in the whole model (``Entry.merged``). A run of one stage
    keeps its names and the other run's calls take them; with stages on both sides, the
    bench's calls are numbered in the whole model's order and the target's take those numbers.
    A call without a counterpart is numbered after every number of its API in use."""
    basis, other = (bench, target) if bench.num_stages == 1 or target.num_stages > 1 else (target, bench)
    numbers: dict[str, dict[tuple, int]] = defaultdict(dict)
    used: Counter[str] = Counter()
    for entry in _api_calls(basis):
        number = entry.number if basis.num_stages == 1 else used[entry.key]
        used[entry.key] = max(used[entry.key], number + 1)
        if entry.anchor is not None:
            numbers[entry.key][entry.anchor] = number
        entry.merged = f"{entry.key}.{number}.forward"
    fresh = Counter(used)
    for entry in _api_calls(other):
        number = numbers[entry.key].get(entry.anchor) if entry.anchor is not None else None
        if number is None:
            number = fresh[entry.key]
            fresh[entry.key] += 1
        else:
            entry.repeat = False  # matched: compared
        entry.merged = f"{entry.key}.{number}.forward"
    for entry in _api_calls(basis):
        entry.repeat = False
    for side in (basis, other):
        _name_modules(side)
        for entries in side.entries.values():
            forward = {(e.key, e.number): e.merged for e in entries
                       if e.kind != "other" and not e.backward and e.merged is not None}
            for entry in entries:
                if entry.kind != "other" and entry.backward and (entry.key, entry.number) in forward:
                    head, _, tail = forward[entry.key, entry.number].rpartition(".forward")
                    entry.merged = f"{head}.backward{tail}"
                elif entry.merged is None:
                    entry.merged = entry.name


def _api_calls(side: Side) -> list[Entry]:
    """The API forward calls of a run, in the whole model's order."""
    return sorted((e for entries in side.entries.values() for e in entries if e.kind == "api" and not e.backward),
                  key=lambda e: e.order)


def _name_modules(side: Side) -> None:
    """Modules keep their names; a module several stages call is numbered by its whole calls
    (by micro-batch, then by call within the micro-batch), each stage's part under that name."""
    calls: Counter[tuple] = Counter()
    whole_call: dict[int, tuple[int, int]] = {}
    for entry in sorted((e for entries in side.entries.values() for e in entries
                         if e.kind == "module" and e.key in side.split and not e.backward and e.micro is not None),
                        key=lambda e: e.number):
        whole_call[id(entry)] = (entry.micro, calls[entry.key, entry.stage, entry.micro])
        calls[entry.key, entry.stage, entry.micro] += 1
    wholes: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for entries in side.entries.values():
        for entry in entries:
            if id(entry) in whole_call:
                wholes[entry.key].append(whole_call[id(entry)])
    for entries in side.entries.values():
        for entry in entries:
            if id(entry) in whole_call:
                entry.merged = f"{entry.key}forward.{sorted(set(wholes[entry.key])).index(whole_call[id(entry)])}"


# --- putting the stages together -----------------------------------------------------------------------


def _renamed(leaves: list[Leaf], old: str, new: str) -> list[Leaf]:
    if old == new:
        return leaves
    return [replace(leaf, name=new + leaf.name[len(old):] if leaf.name.startswith(old) else leaf.name, entry=new)
            for leaf in leaves]


def _stage_dump(side: Side, name: str, dump: RankDump, entries: list[Entry], stage: int, mode: str) -> RankDump:
    """The entries of ``stage`` in one rank's dump (the tensor-parallel peers hold the same
    entries as the pipeline rank), under their whole-model names."""
    by_name = {entry.name: entry for entry in entries}
    repeats = {(entry.key, entry.number): entry.repeat for entry in entries if entry.kind == "api" and not entry.backward}
    leaves, stacks = [], {}
    for entry_name, group in itertools.groupby(dump.leaves, key=lambda leaf: leaf.entry):
        entry = by_name.get(entry_name)
        if entry is None or entry.stage != stage:
            continue
        group = _renamed(list(group), entry.name, entry.merged)
        if entry.kind == "api" and entry.micro is None:
            group = [replace(leaf, problem=(UNMATCHED, OUTSIDE)) for leaf in group]
        elif entry.repeat or (entry.backward and repeats.get((entry.key, entry.number), False)):
            group = [replace(leaf, problem=(UNMATCHED, REPEATED)) for leaf in group]
        leaves += group
        if entry_name in dump.stacks:
            stacks[entry.merged] = dump.stacks[entry_name]
    return RankDump(name, mode, leaves, stacks)


def whole(side: Side, other: Side) -> tuple[RankDump, dict[str, list[list]]]:
    """``side``'s ranks as one dump of the whole model, and where each entry came from
    ([rank folder, entry there, stage] of each part)."""
    mode = next(iter(side.dumps.values())).mode
    reference = RankDump("reference", mode, [leaf for name, _, layout, _ in other.ranks for stage in layout.stages
                                             for leaf in _stage_dump(other, name, other.dumps[name], other.entries[name],
                                                                     stage, mode).leaves], {}, ranks=other.tp)
    parts: dict[str, list[tuple[int, list[Leaf], Entry]]] = defaultdict(list)
    stacks: dict[str, list[str]] = {}
    origins: dict[str, list[list]] = defaultdict(list)
    peers: dict[str, list[RankDump]] = {}
    sent: dict[str, list[Leaf]] = {}
    """Split module entry -> the values its last stage so far passes on (forward: outputs;
    backward: the gradients of its outputs), whole."""
    held = sorted((stage, name, path, group) for name, path, layout, group in side.ranks for stage in layout.stages
                  if stage is not None)
    for stage, name, path, group in held:
        entries = side.entries[name]
        if name not in peers:
            peers[name] = [side.dumps[name]] + [read_rank(path.parent / peer) for peer in group if peer != name]
        shards = [_stage_dump(side, dump.name, dump, entries, stage, mode) for dump in peers[name]]
        by_merged = {entry.merged: entry for entry in entries if entry.stage == stage}
        if len(shards) > 1:
            hints = {}
            for entry_name, group_leaves in itertools.groupby(shards[0].leaves, key=lambda leaf: leaf.entry):
                if entry_name in sent:  # received: whole as the previous stage sent it
                    receiving = "output" if by_merged[entry_name].backward else "input"
                    hints.update({leaf.name: whole_leaf for leaf, whole_leaf in
                                  zip((leaf for leaf in group_leaves if leaf.side == receiving), sent[entry_name],
                                      strict=False)})
            merged = merge_ranks(shards, reference, hints)
        else:
            merged = shards[0]
        stacks.update(shards[0].stacks)
        for entry_name, group_leaves in itertools.groupby(merged.leaves, key=lambda leaf: leaf.entry):
            entry = by_merged[entry_name]
            leaves = list(group_leaves)
            parts[entry_name].append((stage, leaves, entry))
            origins[entry_name].append([name, entry.name, stage])
            if entry.kind == "module" and entry.key in side.split:
                sent[entry_name] = [leaf for leaf in leaves if leaf.side == ("input" if entry.backward else "output")]
    combined: list[tuple[tuple, list[Leaf]]] = []
    for entry_name, found in parts.items():
        if len(found) == 1:
            combined.append((found[0][2].order, found[0][1]))
            continue
        first, last = found[0][2], found[-1][2]
        if first.kind == "module" and first.key in side.split:
            leaves = _backward_whole(found) if first.backward else _forward_whole(found)
            combined.append((first.order if first.backward else last.order, leaves))
        elif first.kind == "other" and ".parameters_grad" in entry_name:
            combined.append((first.order, _gradient_sum(found, mode)))
        else:
            reason = f"recorded by pipeline stages {[s for s, _, _ in found]}, which do not split it between them"
            combined.append((first.order, [replace(leaf, problem=(UNMATCHED, reason)) for leaf in found[0][1]]))
    combined.sort(key=lambda item: item[0])
    leaves = [leaf for _, group in combined for leaf in group]
    ranks = sum(len(group) for _, _, _, group in side.ranks)
    return RankDump(side.name, mode, leaves, stacks, ranks=ranks), dict(origins)


HANDOFF_TOLERANCE = 1e-6
"""Relative tolerance of the Mean and Norm of a value one stage sends and the next receives:
where tensor-parallel shards were put together, they are combined from the shards'."""


def _same(a: Leaf, b: Leaf) -> str | None:
    """What differs between two records of the value one stage sends and the next receives."""
    if a.is_tensor != b.is_tensor:
        return "one is a tensor, the other not"
    if not a.is_tensor or a.problem is not None or b.problem is not None:
        return None
    for key in ("dtype", "shape", *_STATS, "md5"):
        x, y = a.record.get(key), b.record.get(key)
        if x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
            continue
        if key in ("Mean", "Norm") and isinstance(x, (int, float)) and isinstance(y, (int, float)) and math.isclose(
                x, y, rel_tol=HANDOFF_TOLERANCE, abs_tol=1e-12):
            continue
        return f"{key} {x} against {y}"
    return None


def _flag_handoffs(leaves: list[Leaf], found: list, sent: str, received: str, what: str) -> list[Leaf]:
    """Flag the ``leaves`` (the whole record's outputs) when a stage's ``sent`` values are not
    the next stage's ``received`` ones."""
    problems = []
    for (stage, before, _), (after_stage, after, _) in itertools.pairwise(found):
        outs = [leaf for leaf in before if leaf.side == sent]
        ins = [leaf for leaf in after if leaf.side == received][: len(outs)]
        for i, (out, into) in enumerate(zip(outs, ins, strict=False)):
            difference = _same(out, into)
            if difference is not None:
                problems.append(f"stage {stage}'s {what} {i} is not stage {after_stage}'s (the pipeline sends it as "
                                f"is): {difference}")
    if not problems:
        return leaves
    return [replace(leaf, problem=(WARNING, "; ".join(problems))) if leaf.problem is None else leaf for leaf in leaves]


def _forward_whole(found: list) -> list[Leaf]:
    """A module call several stages split: the first stage's inputs and parameters, the last
    stage's outputs; each stage's output is checked against the next stage's input."""
    first, last = found[0][1], found[-1][1]
    outputs = _flag_handoffs([leaf for leaf in last if leaf.side == "output"], found, "output", "input", "output")
    return [leaf for leaf in first if leaf.side != "output"] + outputs


def _backward_whole(found: list) -> list[Leaf]:
    """Its backward: the last stage's output gradients (input), the first stage's input
    gradients (output); each stage's input gradients are checked against the previous stage's
    output gradients."""
    first, last = found[0][1], found[-1][1]
    reverse = [(stage, leaves, entry) for stage, leaves, entry in reversed(found)]
    outputs = _flag_handoffs([leaf for leaf in first if leaf.side == "output"], reverse, "output", "input",
                             "input gradient")
    return [leaf for leaf in last if leaf.side != "output"] + outputs


def _gradient_sum(found: list, mode: str) -> list[Leaf]:
    """A parameter gradient recorded by several stages: the sum of their parts."""
    stages = [stage for stage, _, _ in found]
    by_name: dict[str, list[Leaf]] = defaultdict(list)
    for _, leaves, _ in found:
        for leaf in leaves:
            by_name[leaf.name].append(leaf)
    summed = []
    for parts in by_name.values():
        first = parts[0]
        if mode == "tensor" and all(len(p.files) == 1 and p.join is None for p in parts) and len(parts) == len(found):
            files = tuple(p.files[0] for p in parts)
            total = load_tensor(replace(first, files=files, join=("sum", None))).float()
            record = dict(first.record)
            record.update(zip(_STATS, (total.max().item(), total.min().item(), total.mean().item(), total.norm().item()),
                              strict=True))
            record.pop("md5", None)
            summed.append(replace(first, record=record, files=files, join=("sum", None)))
        else:
            why = ("the statistics of parts do not give the sum's" if mode != "tensor"
                   else "not every part was saved as one whole tensor")
            summed.append(replace(first, problem=(UNMATCHED, SHARED_GRADIENT.format(stages=stages, why=why))))
    return summed


def pipeline_pair(targets: dict[str, Path], benches: dict[str, Path]) -> tuple[RankDump, RankDump, dict[str, Any]]:
    """The target and the bench, each put together into one dump of the whole model, and where
    their entries came from (for merged_names.json)."""
    target, bench = place("target", targets), place("bench", benches)
    name_entries(target, bench)
    whole_target, target_origins = whole(target, bench)
    whole_bench, bench_origins = whole(bench, target)
    return whole_target, whole_bench, {"target": target_origins, "bench": bench_origins}
