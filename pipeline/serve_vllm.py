"""``serve_vllm``: vLLM's OpenAI-compatible server (``.venv-vllm``, ``make vllm``) on the embedded default, the shipped
drafter and BlockPilot's plugin, in the foreground until Ctrl-C.

    make serve-vllm                                        # python -m pipeline.serve_vllm: dflash K=7, policy budget
    make serve-vllm ARGS="vllm.policy=off vllm.port=8001"  # vLLM's own DFlash
    make serve-vllm ARGS="vllm.method=ar vllm.policy=off"  # no speculation (a policy applies to dflash)

``conf/serve_vllm.yaml`` lists the options; ``pipeline.peers.vllm_server.VllmServer`` is the launcher (also
the Python API of the benchmarks and tests); docs/vllm.md explains the plugin.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf


def server_of(cfg: DictConfig):
    """The ``VllmServer`` of a ``serve_vllm`` config (``vllm.*``)."""
    from pipeline.peers.vllm_server import VllmServer

    options = OmegaConf.to_container(cfg.vllm, resolve=True)
    return VllmServer(**options)


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve_vllm")
def main(cfg: DictConfig) -> None:
    from pipeline.config_checks import validate_config

    validate_config(cfg, "serve_vllm")
    server = server_of(cfg)
    print(f"vLLM ({server.method}, policy {server.policy}) on {server.openai_url}, model {server.model}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
