"""Deterministic mode: the same inputs give bitwise the same run.

Follows msprobe's ``seed_all`` (Ascend/mstt, ``debug/accuracy_tools/msprobe/docs/05.data_dump_PyTorch.md``,
section 1.8) for the seeds and switches it lists. Data order needs nothing here: llmflow's
samplers draw their order from the training seed (``llmflow/train/data.py``).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from llmflow import runtime


def seed_all(seed: int = 1234, deterministic: bool = True) -> None:
    """Seed Python, numpy, torch and the device's generators with ``seed``; with
    ``deterministic``, also make every kernel and collective deterministic.

    Call it before the process group starts: HCCL reads HCCL_DETERMINISTIC when it
    initialises, cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its first handle is made.
    """
    os.environ["PYTHONHASHSEED"] = str(seed)  # for the processes this one starts
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    device_type = runtime.detect_device_type()
    if device_type != "cpu":
        torch.get_device_module(device_type).manual_seed_all(seed)
    if not deterministic:
        return
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    os.environ["HCCL_DETERMINISTIC"] = "true"
    # No K-axis split in NPU matmuls (MindSpeed's npu_deterministic sets the same).
    os.environ["CLOSE_MATMUL_K_SHIFT"] = "1"
    # torch_npu honours this switch for CANN operators as CUDA kernels do.
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
