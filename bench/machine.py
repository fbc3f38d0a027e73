"""What the benchmarks record about the machine they ran on."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def own_memory_mib(field: str = "VmHWM") -> float:
    """VmRSS (now) or VmHWM (peak) of this process in MiB. Unlike ru_maxrss, VmHWM starts
    afresh at exec, so a benchmark's child process does not report its parent's memory."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.is_file() else []:
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory on ``device`` in MiB: its high-water RSS on the CPU, else
    the device's ``max_memory_allocated``."""
    if device.type == "cpu":
        return own_memory_mib()
    return torch.get_device_module(device.type).max_memory_allocated(device) / 2**20
