"""BlockPilot: instance-adaptive block sizes for DFlash-style speculative decoding.

Stages (each a thin Hydra entry point): ``draft`` trains a drafter, ``label`` records tau(B) per
prompt, ``dataset`` builds prefill-distribution features, ``train`` fits the block-size policy,
``evaluate`` decodes with every method and reports tau, speedup and losslessness.
"""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = PROJECT_ROOT / "data"

try:
    from omegaconf import OmegaConf as _OmegaConf
except ImportError:  # vLLM's environment (the plugin, pipeline.integrations.vllm) has no Hydra: no config to resolve
    _OmegaConf = None
if _OmegaConf is not None:
    # `${project_root:}` in conf/ resolves to this checkout, wherever Hydra runs from.
    _OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
