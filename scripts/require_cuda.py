"""Exit with an error when torch sees no CUDA device, else print the device (scripts/gpu_*.sh call it).

    python scripts/require_cuda.py <caller name> [module to import ...]
"""

import importlib
import sys

import torch

name, modules = (sys.argv[1] if len(sys.argv) > 1 else "gpu"), sys.argv[2:]
if not torch.cuda.is_available():
    raise SystemExit(f"{name}: no CUDA device visible to torch")
for module in modules:  # dependencies of the stages the caller runs
    importlib.import_module(module)
print(f"{name}:", torch.cuda.get_device_name(0), "torch", torch.__version__)
