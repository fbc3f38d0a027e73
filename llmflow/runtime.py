"""Devices, dtypes and distributed start-up: the one place that knows npu/cuda/cpu apart.

Everything device-specific is read from ``DEVICES``; the rest of llmflow asks this module
which device it runs on and never branches on device names itself.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DeviceSpec:
    """How llmflow drives one kind of device."""

    type: str
    """torch device type: 'npu', 'cuda' or 'cpu'."""
    backend: str
    """torch.distributed backend for collectives on this device."""
    default_dtype: torch.dtype
    """Compute dtype for training and inference unless the user asks for another."""
    visible_devices_env: str
    """Environment variable that restricts which devices a process sees."""


DEVICES: dict[str, DeviceSpec] = {
    "npu": DeviceSpec("npu", "hccl", torch.bfloat16, "ASCEND_RT_VISIBLE_DEVICES"),
    "cuda": DeviceSpec("cuda", "nccl", torch.bfloat16, "CUDA_VISIBLE_DEVICES"),
    "cpu": DeviceSpec("cpu", "gloo", torch.float32, ""),
}

DEVICE_ENV = "LLMFLOW_DEVICE"
"""Environment variable that forces the device type (cpu, cuda, npu) over detection."""

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@functools.cache
def npu_available() -> bool:
    """True when torch_npu imports and sees at least one NPU.

    torch_npu is optional. Installed without a working CANN runtime, its import raises
    ImportError or RuntimeError (or fails inside its own C extension); all of these mean
    "no NPU here" rather than a crash.
    """
    try:
        torch_npu = importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError):
        return False
    try:
        return bool(torch_npu.npu.is_available())
    except RuntimeError:
        return False


def detect_device_type() -> str:
    """The best device type on this machine: npu, then cuda, then cpu.

    ``LLMFLOW_DEVICE`` overrides the choice (e.g. to force cpu on a GPU host).
    """
    forced = os.environ.get(DEVICE_ENV)
    if forced:
        if forced not in DEVICES:
            raise ValueError(f"LLMFLOW_DEVICE={forced!r}: expected one of {sorted(DEVICES)}")
        return forced
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def device_spec(device_type: str | None = None) -> DeviceSpec:
    """The DeviceSpec for ``device_type`` (detected when None)."""
    device_type = device_type or detect_device_type()
    try:
        return DEVICES[device_type]
    except KeyError:
        raise ValueError(f"unknown device type {device_type!r}: expected one of {sorted(DEVICES)}") from None


def device_count(device_type: str) -> int | None:
    """Devices of this type the process sees; None for cpu, where ranks are processes."""
    if device_type == "cpu":
        return None
    npu_available()  # torch.npu exists once torch_npu is imported
    return torch.get_device_module(device_type).device_count()


def available_device(device: str | torch.device) -> torch.device:
    """``device`` ("cpu", "cuda", "npu", optionally with an index: "cuda:1") as a torch.device,
    once it is known to exist on this machine; ValueError naming it otherwise, before any work."""
    if isinstance(device, torch.device):
        device = str(device)
    device_type, _, index = device.partition(":")
    if device_type not in DEVICES or (index and not index.isdigit()):
        raise ValueError(f"device {device!r}: expected one of {sorted(DEVICES)}, optionally with an index (cuda:1)")
    if device_type == "cpu":
        return torch.device(device)
    if device_type == "npu" and not npu_available():
        raise ValueError(f"device {device!r}: no Ascend NPU here (torch_npu is not installed or sees none); use cpu")
    count = device_count(device_type)
    if not count:
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        raise ValueError(f"device {device!r}: no {device_type} device here ({why}); use cpu")
    if index and int(index) >= count:
        raise ValueError(f"device {device!r}: only {count} {device_type} device(s) are visible")
    return torch.device(device)


def bf16_supported(device_type: str) -> bool:
    """Whether the device computes in bfloat16 natively."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device_type == "npu"


def resolve_dtype(requested: str | torch.dtype | None, device_type: str) -> torch.dtype:
    """The compute dtype: ``requested`` if given, else bf16 on accelerators that support
    it (fp16 on those that do not), fp32 on CPU."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested is not None and requested != "auto":
        try:
            return DTYPES[requested]
        except KeyError:
            raise ValueError(f"dtype={requested!r}: expected 'auto' or one of {sorted(DTYPES)}") from None
    spec = device_spec(device_type)
    if spec.default_dtype == torch.bfloat16 and not bf16_supported(device_type):
        return torch.float16
    return spec.default_dtype


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env_from_environ(device_type: str | None = None) -> DistEnv:
    """Rank, world size and local device from torchrun's environment (single process
    when the variables are absent)."""
    device_type = device_type or detect_device_type()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, local_rank)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def init_distributed(device_type: str | None = None, timeout_s: float = 1800.0) -> DistEnv:
    """Set the local device and join the process group with the device's backend.

    Safe to call in a plain (non-torchrun) process: with world size 1 and no rendezvous
    address it returns without creating a process group.
    """
    spec = device_spec(device_type)
    env = dist_env_from_environ(spec.type)
    if spec.type != "cpu":
        torch.accelerator.set_device_index(env.local_rank)
    if (env.world_size > 1 or "MASTER_ADDR" in os.environ) and not dist.is_initialized():
        dist.init_process_group(
            backend=spec.backend,
            device_id=None if spec.type == "cpu" else env.device,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return env


def destroy_distributed() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
