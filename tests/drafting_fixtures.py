"""Shared pieces of the drafter-training tests: the tapped layers, the prompt texts, the tiny Llama target and
its chat-templated prompts (module-scoped: tests that change a target load their own copy)."""

from __future__ import annotations

import pytest
import torch

from pipeline.prompts import chat_input_ids

LAYERS = [0, 2]
TEXTS = ["def add(a, b):", "Natalia sold clips to 48 of her friends in April", "hello", "The quick brown fox jumps"]


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny.target("llama")


@pytest.fixture(scope="module")
def prompt_ids(llama) -> list[torch.Tensor]:
    return [chat_input_ids(llama.tokenizer, [t])[0] for t in TEXTS]


def train_steps(module, batch: dict, steps: int) -> list[float]:
    """Run ``steps`` optimizer steps of ``module`` (a ``DrafterModule`` with no Trainer) on one batch; the losses."""
    optimizer = module.configure_optimizers()["optimizer"]
    losses = []
    for _ in range(steps):
        loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses
