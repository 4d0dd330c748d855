"""The install check of ``make vllm``: ``python -m pipeline.integrations.vllm.check`` in ``.venv-vllm``.

Imports vLLM (so a broken torch/torchvision pairing fails the install, not the first server start), checks that its
version is the series the plugin wraps, and that BlockPilot's plugin is registered under ``vllm.general_plugins``.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

from pipeline.peers.vllm_settings import check_vllm_version

ENTRY_POINT = "pipeline.integrations.vllm.plugin:register"


def main() -> None:
    """Print vLLM's version and the plugin's entry point.

    Raises:
        RuntimeError: for another vLLM series, or when the entry point is missing (reinstall with ``make vllm``).
    """
    import vllm

    check_vllm_version(vllm.__version__)
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    if ENTRY_POINT not in plugins.values():
        raise RuntimeError(f"BlockPilot's vLLM plugin ({ENTRY_POINT}) is not registered under vllm.general_plugins "
                           f"(found {plugins}); reinstall it: {sys.executable} -m pip install --no-deps -e .")
    print(f"vllm {vllm.__version__}; plugins: {plugins}")


if __name__ == "__main__":
    main()
