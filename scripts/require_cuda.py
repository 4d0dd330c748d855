"""Exit with an error when torch sees no CUDA device, else print the device (scripts/gpu_*.sh call it).

    python scripts/require_cuda.py <caller name> [module to import ...]
    python scripts/require_cuda.py <caller name> --device cpu|cuda --versions OUT.json

``--versions`` writes (and prints) the software and device a check ran on: Python, torch, its CUDA and cuDNN builds,
transformers, the GPU (name, compute capability, memory) or the CPU; with ``--device cpu`` no GPU is required.
"""

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

import torch

parser = argparse.ArgumentParser()
parser.add_argument("name", nargs="?", default="gpu")
parser.add_argument("modules", nargs="*", help="dependencies of the stages the caller runs")
parser.add_argument("--device", default="cuda")
parser.add_argument("--versions", default=None, help="write the versions JSON here")
args = parser.parse_args()

if args.device != "cpu" and not torch.cuda.is_available():
    raise SystemExit(f"{args.name}: no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
                     "run with DEVICE=cpu for the CPU path")
for module in args.modules:
    importlib.import_module(module)
if args.versions:
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "transformers": transformers.__version__, "device": args.device, "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if args.device != "cpu":
        props = torch.cuda.get_device_properties(0)
        info.update({"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
                     "gpu_memory_gib": round(props.total_memory / 2**30, 1), "gpu_count": torch.cuda.device_count()})
    Path(args.versions).parent.mkdir(parents=True, exist_ok=True)
    Path(args.versions).write_text(json.dumps(info, indent=1) + "\n")
elif args.device != "cpu":
    print(f"{args.name}:", torch.cuda.get_device_name(0), "torch", torch.__version__)
