"""Dump training steps in msprobe's layout, so msprobe's tools and ``llmflow probe compare`` read them.

``with dumper.step(n):`` around the forward and backward passes of step ``n`` writes, when
the config lists the step and this rank::

    {dump_path}/step{n}/rank{r}/dump.json        # "rank" without a number outside torchrun
                               /stack.json
                               /construct.json
                               /layout.json             # llmflow's, not msprobe's: see below
                               /dump_tensor_data/*.pt   # task tensor

(msprobe's layout: Ascend/mstt, ``debug/accuracy_tools/msprobe/docs/05.data_dump_PyTorch.md``
section 3; dump.json as in ``docs/27.dump_json_instruction.md``). The rank folder is built
under a temporary name and renamed when the step ends, so a folder that exists is complete.

- Level L0 records every submodule of the model (not the model itself, as msprobe) through
  forward pre/post hooks: ``Module.{name}.{Class}.forward.{n}`` with input_args,
  input_kwargs, output and the module's own parameters, ``Module.{name}.{Class}.backward.{n}``
  with input (gradients of the outputs) and output (gradients of the inputs), and
  ``Module.{name}.{Class}.parameters_grad.{n}``. ``n`` counts the module's calls in the step.
- Level L1 records torch API calls through a TorchFunctionMode (nothing in torch is
  patched): ``Functional.linear.{n}.forward`` / ``.backward``, ``Tensor.add.{n}.forward``,
  ``Torch.matmul.{n}.forward``; ``n`` counts the API's calls in the step. Calls that return
  no tensor are not recorded; an in-place call's output is its first argument after the call.
- Level mix records both; construct.json then gives each API call its enclosing module.

Backward records come from ``torch.utils.hooks.BackwardHook``, the mechanism behind
``register_full_backward_hook`` (msprobe uses the same). Like module backward hooks, it
forbids in-place changes to the outputs of a hooked call ("Output 0 of BackwardHookFunction
is a view and is being modified inplace"); dump such code with data_mode ["forward"]. For
the same reason FSDP2 warns, in a dumped step, that a wrapped module "returned a view
tensor": harmless unless the caller changes that output in place.

parameters_grad records the gradient a rank computes for a parameter, before any
reduction across data-parallel ranks (under FSDP2: the unsharded parameter's). A parameter
that gets a gradient while no module holding it ran in the step (an output projection's
weight, which the loss uses without calling the module; on the last pipeline stage, the
tied embedding) is recorded under the first module holding it. API calls made by
torch.distributed itself (DTensor redistribution, parallel styles, FSDP2's all-gathers) are
not recorded: they differ between parallel layouts. Neither are those of context
parallelism's own code (``models/context_parallel.py``: cutting the inputs into each rank's
part of the sequence, Ulysses' reshaping around its all-to-alls), so a Ulysses cp run
records the calls of a run without it; the attention kernel Ulysses calls is recorded, on
its head shards of the whole sequence. Nor are the calls of the metadata inference of
``torch.distributed.pipelining`` (the first step of a schedule runs each stage
once more, on the first micro-batch, on uninitialised tensors after the first stage, to
learn the shapes it sends), so a stage's modules are numbered as in a run without pipeline.
Steps run with torch.compile are not supported.

layout.json (llmflow's own file, which msprobe's compare ignores) records where the rank
sits, so that ``llmflow probe compare`` can put the ranks of a run together::

    {"rank": 2,                          # null outside a process group
     "stages": [1],                      # pipeline stage of each module given to the Dumper
     "num_stages": 2,
     "pipeline_group": [0, 2],           # global ranks of this rank's pipeline group, by group rank
     "meshes": [{"dims": ["tp"], "ranks": [2, 3]}],   # device meshes of the DTensor parameters
     "cp_group": null,                   # global ranks of its context-parallel group, by cp rank
     "cp_algo": null,                    # under cp: "ulysses" or "ring"
     "calls": [{"stage": 1, "counts": {"Functional.linear": [0, 14], "Module.model.DecoderModel.": [0, 1]},
                "tokens": [2, 32]}]}

``calls`` lists each forward call of a given module (a pipeline stage: one per micro-batch),
in order, with the numbers its calls took: ``[first, end)`` per API and per module, and the
batch size and positions of its first tensor input (token ids or hidden states; under cp the
rank's part of the sequence). Outside pipelining ``stages`` numbers the given modules by
position, ``pipeline_group`` is null.
``cp_group`` and ``cp_algo`` come from the attention layers ``apply_cp`` changed: FSDP2
shards over dp and cp flattened ("dp_cp"), so no DTensor's mesh names the cp group.
"""

from __future__ import annotations

import contextlib
import functools
import json
import linecache
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import BackwardHook

from llmflow.artifacts import atomic_directory
from llmflow.models import context_parallel
from llmflow.probe.dump.apis import SKIPPED, api_name, is_inplace
from llmflow.probe.dump.config import ProbeConfig
from llmflow.probe.dump.records import RecordBuilder, cpu_threads
from llmflow.probe.dump.scope import CallFilter, backward_name

TENSOR_DIR = "dump_tensor_data"
_TORCH = str(Path(torch.__file__).resolve().parent) + "/"
_DISTRIBUTED = _TORCH + "distributed/"
_PIPELINING = _DISTRIBUTED + "pipelining/"
_CONTEXT_PARALLEL = context_parallel.shard_sequence.__code__.co_filename
LAYOUT = "layout.json"
"""llmflow's record of where a rank sits (pipeline stages, meshes, cp group, stage calls); not msprobe's."""
_METADATA_INFERENCE = frozenset({"_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference"})
"""The functions of torch.distributed.pipelining that run a stage to learn its shapes."""
# Frames of torch itself (module call machinery, the function mode) and of the probe tell
# nothing about where the model made the call.
_HIDDEN_FRAMES = (_TORCH, str(Path(__file__).resolve().parent) + "/")


def _called_for_layout(frame: Any) -> bool:
    """Whether the API call seen from ``frame`` was made for the parallel layout rather than
    by the model: the nearest frame outside torch's other code is in torch.distributed
    (DTensor, parallel styles, FSDP2) or in context parallelism's own code. That bookkeeping
    differs between parallel layouts and would shift every later call count."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH):
            return filename == _CONTEXT_PARALLEL
        if filename.startswith(_DISTRIBUTED):
            return True
        frame = frame.f_back
    return False


def _in_metadata_inference(frame: Any) -> bool:
    """Whether ``frame`` runs inside torch.distributed.pipelining's metadata (shape) inference."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _METADATA_INFERENCE and code.co_filename.startswith(_PIPELINING):
            return True
        frame = frame.f_back
    return False


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of a process group, in the order of their ranks in the group."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return sorted(ranks, key=lambda r: dist.get_group_rank(group, r) if group is not None else r)


def _meshes(model: list[nn.Module]) -> list[dict[str, Any]]:
    """The device meshes of the DTensor parameters of ``model``: dimension names and ranks."""
    found: list[dict[str, Any]] = []
    for root in model:
        for param in root.parameters():
            if isinstance(param, DTensor):
                mesh = param.device_mesh
                entry = {"dims": list(mesh.mesh_dim_names or ()), "ranks": mesh.mesh.tolist()}
                if entry not in found:
                    found.append(entry)
    return found


def _context_parallel(model: list[nn.Module]) -> tuple[list[int], str] | None:
    """The global ranks of the context-parallel group of ``model``'s attention layers (in
    cp-rank order) and its algorithm, as ``apply_cp`` left them; None without context parallelism."""
    for root in model:
        for module in root.modules():
            place = getattr(module, "context_parallel", None)
            if place is not None:
                return _group_ranks(place.group), place.algo
    return None


def call_stack() -> tuple[str, ...]:
    """The caller's stack, innermost frame first, in msprobe's stack.json line format,
    without torch's and the probe's own frames."""
    positions = []
    frame = sys._getframe(1)
    while frame is not None:
        positions.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return _format_stack(tuple(positions))


@functools.lru_cache(maxsize=4096)
def _format_stack(positions: tuple) -> tuple[str, ...]:
    lines = []
    for code, line in positions:
        source = linecache.getline(code.co_filename, line).strip()
        if source and not code.co_filename.startswith(_HIDDEN_FRAMES):
            lines.append(f"File {code.co_filename}, line {line}, in {code.co_name}, \n {source}")
    return tuple(lines)


def _class_name(module: nn.Module) -> str:
    # fully_shard swaps in a class "FSDP{Name}"; keep the model's own name so layouts compare.
    name = type(module).__name__
    return name.removeprefix("FSDP") if isinstance(module, FSDPModule) else name


def _as_tuple(value: Any) -> tuple:
    if isinstance(value, tuple):
        return value
    return tuple(value) if isinstance(value, list) else (value,)


def _tokens(args: tuple, kwargs: dict[str, Any]) -> list[int] | None:
    """[batch, positions]: the first two sizes of a stage's first tensor input (token ids
    [B, S] or hidden states [B, S, hidden]); None without one."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            return list(value.shape[:2])
    return None


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return False


def _write_json(path: Path, payload: Any) -> None:
    # Without indentation json uses its C encoder: several times faster on a large dump. The
    # payload is plain dicts and lists built here: no cycle to check for.
    path.write_text(json.dumps(payload, check_circular=False), encoding="utf-8")


@dataclass(frozen=True)
class PipelinePlace:
    """Where the modules given to a Dumper run in a ``torch.distributed.pipelining`` schedule."""

    stages: list[int]
    """The pipeline stage of each given module."""
    num_stages: int
    group: dist.ProcessGroup | None
    """The pipeline's process group (None: the default group)."""


class Dumper:
    """Dumps the steps a ProbeConfig lists; ``model`` is the module whose submodules level
    L0/mix records (or this rank's pipeline stages, whose modules keep the whole model's
    names, with ``pipeline`` saying which stages they are). Nothing is installed outside a
    dumped step."""

    def __init__(self, config: ProbeConfig, model: nn.Module | list[nn.Module],
                 pipeline: PipelinePlace | None = None) -> None:
        self.config = config
        self.model = model if isinstance(model, list) else [model]
        self.pipeline = pipeline
        self.rank = dist.get_rank() if dist.is_initialized() else None

    @property
    def rank_dir(self) -> str:
        """msprobe's rank folder name: rank{R}, or rank outside a process group."""
        return "rank" if self.rank is None else f"rank{self.rank}"

    def step(self, step: int) -> contextlib.AbstractContextManager:
        """Context of step ``step`` (0-based, as msprobe counts): dumps it when listed."""
        if not self.config.dumps(step, self.rank or 0):
            return contextlib.nullcontext()
        return self._dump(step)

    @contextlib.contextmanager
    def _dump(self, step: int) -> Iterator[None]:
        final = Path(self.config.dump_path) / f"step{step}" / self.rank_dir
        with atomic_directory(final) as work:
            session = _Session(self.config, self.model, self.pipeline, work, final, self.rank)
            with session:
                yield
            session.write()


@dataclass
class _Call:
    """A module call between its pre and post hooks."""

    forward: str
    parent: str | None
    record: bool
    inputs: dict[str, Any]
    hook: BackwardHook | None


class _ApiMode(TorchFunctionMode):
    """Sends every named torch API call through the session."""

    def __init__(self, session: _Session) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = api_name(func)
        session = self.session
        if name is None or name in SKIPPED or session.skipping or _called_for_layout(sys._getframe(1)):
            return func(*args, **kwargs)
        if not session.open_roots and _in_metadata_inference(sys._getframe(1)):
            return func(*args, **kwargs)  # pipelining's metadata inference (its loss function)
        return session.api_call(name, func, args, kwargs)


class _Session:
    """What one dumped step records, and the hooks that record it."""

    def __init__(self, config: ProbeConfig, model: list[nn.Module], pipeline: PipelinePlace | None, work: Path,
                 final: Path, rank: int | None = None) -> None:
        self.config = config
        self.model = model
        self.stages = pipeline.stages if pipeline is not None else list(range(len(model)))
        """The pipeline stage of each given module (outside pipelining: its position)."""
        self.pipeline = pipeline
        self.rank = rank
        self.work = work
        self.modes = config.section.data_mode
        tensor_dir = work / TENSOR_DIR if config.task == "tensor" else None
        if tensor_dir is not None:
            tensor_dir.mkdir()
        self.dump_data_dir = str(final / TENSOR_DIR) if tensor_dir is not None else None
        self.records = RecordBuilder(config.md5, tensor_dir, threads=torch.get_num_threads())
        self.filter = CallFilter(config.section.scope, config.section.names)
        self.data: dict[str, dict[str, Any]] = {}
        self.stacks: dict[tuple[str, ...], list[str]] = {}
        self.construct: dict[str, str | None] = {}
        self.counts: defaultdict[str, int] = defaultdict(int)
        self.calls: list[_Call] = []
        self.recorded_modules: set[str] = set()
        self.hooked_parameters: set[int] = set()
        self.called_parameters: set[int] = set()
        """Parameters of the modules called in the step (recorded or not)."""
        self.unused_hooked: set[int] = set()
        self.skipping = 0
        """Depth of the given modules' calls that record nothing (pipelining's metadata inference)."""
        self.open_roots: list[tuple[int, dict[str, int], list[int] | None]] = []
        """The given modules' calls under way: (index, counts when the call started, ``_tokens``)."""
        self.root_calls: list[dict[str, Any]] = []
        self.started_roots: set[int] = set()
        """The given modules called in the step so far (by index)."""
        self.installed = contextlib.ExitStack()

    def __enter__(self) -> None:
        self.installed.enter_context(warnings.catch_warnings())
        # BackwardHook warns when no input of a call needs a gradient (token ids); the
        # gradients of its outputs are recorded all the same.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self._hook_roots()
        if self.config.level != "L1":
            self._hook_modules()
        if self.config.level != "L0":
            self.installed.enter_context(_ApiMode(self))

    def __exit__(self, *exc: object) -> None:
        self.installed.__exit__(*exc)

    def write(self) -> None:
        """Write dump.json, stack.json and construct.json into the work folder."""
        with self._quietly():
            self.records.finish()
        dump = {"task": self.config.task, "level": self.config.level, "framework": "pytorch",
                "dump_data_dir": self.dump_data_dir, "data": self.data}
        _write_json(self.work / "dump.json", dump)
        # msprobe groups the calls that share a stack: {"0": [[names], [frames]], ...}
        _write_json(self.work / "stack.json", {str(i): [names, list(stack)] for i, (stack, names) in enumerate(self.stacks.items())})
        _write_json(self.work / "construct.json", self.construct)
        _write_json(self.work / LAYOUT, self._layout())

    def _layout(self) -> dict[str, Any]:
        """layout.json: the pipeline stages, meshes, context-parallel group and stage calls of
        this rank (see the module doc)."""
        pipeline = self.pipeline
        cp_group, cp_algo = _context_parallel(self.model) or (None, None)
        return {"rank": self.rank, "stages": self.stages,
                "num_stages": pipeline.num_stages if pipeline is not None else len(self.model),
                "pipeline_group": _group_ranks(pipeline.group) if pipeline is not None else None,
                "meshes": _meshes(self.model), "cp_group": cp_group, "cp_algo": cp_algo, "calls": self.root_calls}

    # --- recording ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        """The session's own torch work (records, statistics): with torch-function dispatch
        off, so the API mode neither records it nor is called for it, and on one CPU thread.
        Its thousands of small ops gain less from the intra-op pool than waking it costs, and
        on a busy machine every wake-up can wait for a time slice."""
        with cpu_threads(1), torch._C.DisableTorchFunction():
            yield

    def _wants(self, direction: str, side: str) -> bool:
        """msprobe's data_mode test: a record is kept when "all", its direction or its side is listed."""
        return "all" in self.modes or direction in self.modes or side in self.modes

    def _inputs(self, forward: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "input_args": self.records.build(args, f"{forward}.input"),
            "input_kwargs": self.records.build(kwargs, f"{forward}.kwargs"),
        }

    def _add(self, name: str, entry: dict[str, Any], parent: str | None, with_stack: bool) -> None:
        self.data[name] = entry
        if self.config.level != "L1":
            self.construct[name] = parent
        if with_stack:
            self.stacks.setdefault(call_stack(), []).append(name)

    def _add_forward(self, forward: str, parent: str | None, inputs: dict[str, Any], output: Any, params: dict | None = None) -> None:
        entry = dict(inputs)
        if self._wants("forward", "output"):
            entry["output"] = self.records.build(_as_tuple(output), f"{forward}.output")
        if params and self._wants("forward", "input"):
            entry["parameters"] = self.records.build(params, f"{forward}.parameters")
        self._add(forward, entry, parent, with_stack=True)

    def _backward_hook(self, forward: str, parent: str | None) -> BackwardHook | None:
        if not (self._wants("backward", "input") or self._wants("backward", "output")):
            return None
        return BackwardHook(None, [functools.partial(self._backward, forward, parent)], [])

    def _backward(self, forward: str, parent: str | None, _module: Any, grad_input: tuple, grad_output: tuple) -> None:
        with self._quietly():
            name = backward_name(forward)
            entry = {}
            if self._wants("backward", "input"):
                entry["input"] = self.records.build(grad_output, f"{name}.input")
            if self._wants("backward", "output"):
                entry["output"] = self.records.build(grad_input, f"{name}.output")
            self._add(name, entry, backward_name(parent) if parent else None, with_stack=False)

    # --- the given modules (stages): their calls, and pipelining's metadata inference ---------------

    def _hook_roots(self) -> None:
        for index, root in enumerate(self.model):
            for handle in (
                root.register_forward_pre_hook(functools.partial(self._root_pre, index), with_kwargs=True),
                root.register_forward_hook(functools.partial(self._root_post, index), with_kwargs=True, always_call=True),
            ):
                self.installed.callback(handle.remove)

    def _root_pre(self, index: int, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.skipping or _in_metadata_inference(sys._getframe(1)):
            self.skipping += 1  # nothing inside is recorded or counted
            return
        if index not in self.started_roots:
            self.started_roots.add(index)
            if self.config.level != "L1":
                self._hook_unused_parameters(module)
        self.open_roots.append((index, dict(self.counts), _tokens(args, kwargs)))

    def _root_post(self, index: int, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.skipping:
            self.skipping -= 1
            return
        _, before, tokens = self.open_roots.pop()
        counts = {key: [before.get(key, 0), n] for key, n in self.counts.items() if n != before.get(key, 0)}
        self.root_calls.append({"stage": self.stages[index], "counts": counts, "tokens": tokens})

    # --- modules (L0, mix) ---------------------------------------------------------------------------

    def _hook_modules(self) -> None:
        hooked: set[int] = set()
        for root in self.model:
            for qualname, module in root.named_modules():
                if module is not root and id(module) not in hooked:
                    hooked.add(id(module))
                    self._hook_module(qualname, module)

    def _hook_module(self, qualname: str, module: nn.Module) -> None:
        prefix = f"Module.{qualname}.{_class_name(module)}."
        for handle in (
            module.register_forward_pre_hook(functools.partial(self._pre, prefix), with_kwargs=True),
            module.register_forward_hook(functools.partial(self._post, prefix), with_kwargs=True, always_call=True),
        ):
            self.installed.callback(handle.remove)

    def _hook_parameters(self, prefix: str, module: nn.Module) -> None:
        """Hook the gradients of the parameters a module computes with, as its call starts:
        under FSDP2 these are the unsharded parameters its pre-forward hook has just put in
        place (the sharded ones get their gradients from a reduce-scatter, not autograd)."""
        for pname, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in self.hooked_parameters:
                self.hooked_parameters.add(id(param))
                handle = param.register_hook(functools.partial(self._param_grad, prefix, pname))
                self.installed.callback(handle.remove)

    def _hook_unused_parameters(self, root: nn.Module) -> None:
        """Hook the gradient of every parameter of ``root``, as its first call starts (under
        FSDP2 the root's own parameters are unsharded then), under the first module holding
        it; the hook records only a gradient that no called module's hook records (see
        ``_unused_grad``)."""
        for qualname, module in root.named_modules():
            if module is root:
                continue
            prefix = f"Module.{qualname}.{_class_name(module)}."
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad and id(param) not in self.unused_hooked:
                    self.unused_hooked.add(id(param))
                    handle = param.register_hook(functools.partial(self._unused_grad, prefix, pname, id(param)))
                    self.installed.callback(handle.remove)

    def _unused_grad(self, prefix: str, pname: str, key: int, grad: torch.Tensor) -> None:
        """The gradient of a parameter no module called in the step holds (a tied output
        projection's weight on the last pipeline stage): recorded as its first holder's."""
        if self.skipping or key in self.called_parameters or not self._wants("backward", "output"):
            return
        name = f"{prefix}parameters_grad.{self.counts[f'{prefix}parameters_grad.{pname}']}"
        if self.filter.scope or (self.filter.names and not self.filter.listed(name)):
            return
        self._param_grad(prefix, pname, grad, recorded=True)

    def _pre(self, prefix: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if self.skipping:
            return args, kwargs
        with self._quietly():
            self.called_parameters.update(id(p) for p in module.parameters(recurse=False))
            forward = f"{prefix}forward.{self.counts[prefix]}"
            self.counts[prefix] += 1
            parent = self.calls[-1].forward if self.calls else None
            record, record_backward = self.filter.begin(forward, [c.forward for c in self.calls])
            if record:
                self._hook_parameters(prefix, module)
            inputs = self._inputs(forward, args, kwargs) if record and self._wants("forward", "input") else {}
            hook = self._backward_hook(forward, parent) if record_backward else None
            if hook is not None:
                args = hook.setup_input_hook(args)
            self.calls.append(_Call(forward, parent, record, inputs, hook))
        return args, kwargs

    def _post(self, prefix: str, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if self.skipping:
            return output
        with self._quietly():
            call = self.calls.pop()
            if call.record:
                self._add_forward(call.forward, call.parent, call.inputs, output, dict(module.named_parameters(recurse=False)))
                self.recorded_modules.add(prefix)
            self.filter.end(call.forward)
            if call.hook is not None:
                output = call.hook.setup_output_hook(output)
        return output

    def _param_grad(self, prefix: str, pname: str, grad: torch.Tensor, recorded: bool = False) -> None:
        if not (recorded or prefix in self.recorded_modules) or not self._wants("backward", "output"):
            return
        with self._quietly():
            key = f"{prefix}parameters_grad.{pname}"
            name = f"{prefix}parameters_grad.{self.counts[key]}"
            self.counts[key] += 1
            self.data.setdefault(name, {})[pname] = [self.records.build(grad, f"{name}.{pname}")]

    # --- torch APIs (L1, mix) ------------------------------------------------------------------------

    def api_call(self, api: str, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run one API call and record it. The torch function mode is off while this runs,
        so the calls made here (and inside ``func``) are not recorded."""
        forward = f"{api}.{self.counts[api]}.forward"
        parent = self.calls[-1].forward if self.calls else None
        record, record_backward = self.filter.begin(forward, [c.forward for c in self.calls])
        inplace = is_inplace(api)
        wants_inputs = record and self._wants("forward", "input")
        inputs = None
        if inplace and wants_inputs:
            with self._quietly():
                inputs = self._inputs(forward, args, kwargs)  # before the call overwrites them
        hook = None
        if record_backward and not inplace and torch.is_grad_enabled():
            hook = self._backward_hook(forward, parent)
            if hook is not None:
                args = hook.setup_input_hook(args)
        output = func(*args, **kwargs)
        result = args[0] if inplace and args else output
        if _has_tensor(result):
            self.counts[api] += 1
            if record:
                with self._quietly():
                    if wants_inputs and inputs is None:
                        inputs = self._inputs(forward, args, kwargs)
                    self._add_forward(forward, parent, inputs or {}, result)
        self.filter.end(forward)
        if hook is not None:
            output = _hooked_output(hook, output)
        return output


def _hooked_output(hook: Any, output: Any) -> Any:
    """``hook.setup_output_hook(output)``, a ``torch.return_types`` result (``topk``, ``max``)
    rebuilt from its fields: its constructor takes them as one sequence, which the hook's own
    rebuilding of a tuple does not pass."""
    if isinstance(output, tuple) and type(output).__module__ == "torch.return_types":
        return type(output)(hook.setup_output_hook(tuple(output)))
    return hook.setup_output_hook(output)
