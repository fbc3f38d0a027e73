"""llmflow: the life of an LLM as Prefect flows on Ascend NPU, CUDA and CPU."""

import os

# With torch_npu installed but no CANN runtime, torch's device-backend autoload makes
# `import torch` itself fail. llmflow imports torch_npu explicitly and guarded instead
# (see llmflow.runtime), so autoload is off unless the user asked for it.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__version__ = "0.1.0"
