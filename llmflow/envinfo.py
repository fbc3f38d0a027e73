"""``llmflow env``: what llmflow detects on this machine."""

from __future__ import annotations

import json

import torch
from pydantic import BaseModel, ConfigDict

from llmflow import kernels, runtime


def environment_report() -> dict:
    """Detected device, its backend and dtype, the kernels chosen, and the device table."""
    device_type = runtime.detect_device_type()
    spec = runtime.device_spec(device_type)
    return {
        "torch": torch.__version__,
        "device": device_type,
        "backend": spec.backend,
        "dtype": str(runtime.resolve_dtype("auto", device_type)).removeprefix("torch."),
        "kernels": kernels.kernels_for(device_type).name,
        "torch_npu": runtime.npu_available(),
        "cuda_devices": torch.cuda.device_count(),
        "device_table": {name: s.backend for name, s in runtime.DEVICES.items()},
    }


class EnvCommand(BaseModel):
    """Show the devices, backends, dtypes and kernels llmflow would use here."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    json_output: bool = False
    """Print JSON instead of aligned text."""

    def cli_cmd(self) -> None:
        report = environment_report()
        if self.json_output:
            print(json.dumps(report, indent=2))
            return
        for key, value in report.items():
            print(f"{key:<13} {value}")
