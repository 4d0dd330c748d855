"""Training examples for the drafter: cached sequences -> random anchors -> padded batches.

An anchor ``a`` is a response position whose token is known; its block is
``[token_a, mask, ..., mask]`` at positions a..a+B-1, the context is every position < a, and the
labels are ``token_{a+1..a+B-1}`` (DFlash training, Chen et al. 2026, Sec. 3).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

from pipeline.drafting.responses import read_shard


def load_sequences(dirs: list[str | Path], max_len: int | None = None, features: bool = True) -> list[dict]:
    """All cached sequences of the shard folders in ``dirs`` (``tokens``, ``features``, ``final`` where the
    shard has it, ``prompt_length``, ``set`` = the folder's name).

    Sequences whose response is shorter than 2 tokens are dropped; ``max_len`` truncates from the right.
    ``features=False`` drops stored features (the training step computes them: ``draft.features=online``).

    Raises:
        ValueError: ``features=True`` and a shard is token-only.
    """
    sequences = []
    for d in dirs:
        for path in sorted(Path(d).glob("shard-*.safetensors")):
            for seq in read_shard(path):
                seq["set"] = Path(d).name
                if not features:
                    seq.pop("features", None)
                    seq.pop("final", None)
                elif "features" not in seq:
                    raise ValueError(f"{path} holds tokens only (written with draft.features=online); train with "
                                     "draft.features=online or delete that folder to regenerate it with features")
                if max_len is not None and len(seq["tokens"]) > max_len:
                    seq = {**seq, "tokens": seq["tokens"][:max_len]}
                    for key in ("features", "final"):
                        if key in seq:
                            seq[key] = seq[key][:max_len]
                if len(seq["tokens"]) - seq["prompt_length"] >= 2:
                    sequences.append(seq)
    return sequences


class AnchorDataset(Dataset):
    """Each item is one sequence with up to ``anchors_per_seq`` random anchors in its response.

    Anchors are drawn without replacement from response positions a with a + 1 < n (at least one
    label); the draw depends on (seed, epoch, index) so runs are reproducible.
    """

    def __init__(self, sequences: list[dict], anchors_per_seq: int, seed: int = 0):
        self.sequences = sequences
        self.anchors_per_seq = anchors_per_seq
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict:
        seq = self.sequences[index]
        n, p = len(seq["tokens"]), seq["prompt_length"]
        rng = random.Random((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index)
        positions = list(range(p, n - 1))
        anchors = sorted(rng.sample(positions, min(self.anchors_per_seq, len(positions))))
        return {**seq, "anchors": torch.tensor(anchors, dtype=torch.long)}


def collate(items: list[dict]) -> dict:
    """Pad a list of items into a batch.

    Returns:
        tokens [b, L] long (right-padded with 0), features [b, L, F] bf16 (only when every item has
        features), final [b, L, H] bf16 (only when every item has it), lengths [b], anchors [b, K] (padding -1),
        sets (list of b training-set names, when every item has one).
    """
    b = len(items)
    L = max(len(it["tokens"]) for it in items)
    K = max(len(it["anchors"]) for it in items)
    with_features = all("features" in it for it in items)
    with_final = all("final" in it for it in items)
    tokens = torch.zeros(b, L, dtype=torch.long)
    if with_features:
        features = torch.zeros(b, L, items[0]["features"].shape[-1], dtype=items[0]["features"].dtype)
    if with_final:
        final = torch.zeros(b, L, items[0]["final"].shape[-1], dtype=items[0]["final"].dtype)
    anchors = torch.full((b, K), -1, dtype=torch.long)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it["tokens"])
        tokens[i, :n] = it["tokens"]
        if with_features:
            features[i, :n] = it["features"]
        if with_final:
            final[i, :n] = it["final"]
        anchors[i, : len(it["anchors"])] = it["anchors"]
        lengths[i] = n
    batch = {"tokens": tokens, "lengths": lengths, "anchors": anchors}
    if with_features:
        batch["features"] = features
    if with_final:
        batch["final"] = final
    if all("set" in it for it in items):
        batch["sets"] = [it["set"] for it in items]
    return batch


def block_inputs(batch: dict, block_size: int, mask_token_id: int) -> dict:
    """Block tokens, positions, labels and the block-sparse attention mask for a batch.

    Returns:
        block_ids [b, K*B]: anchor token then B-1 mask tokens per block;
        position_ids [b, L + K*B]: context positions 0..L-1 then a_k + i;
        attention_mask bool [b, 1, K*B, L + K*B]: block k sees context positions < a_k and its own block;
        labels [b, K, B-1]: token_{a_k+i} (-100 where past the sequence or for padded anchors).
    """
    tokens, lengths, anchors = batch["tokens"], batch["lengths"], batch["anchors"]
    b, L = tokens.shape
    K, B = anchors.shape[1], block_size
    dev = tokens.device
    valid = anchors >= 0
    a = anchors.clamp(min=0)
    offs = torch.arange(B, device=dev)
    pos = a[:, :, None] + offs  # [b, K, B]
    block_ids = torch.full((b, K, B), mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = tokens.gather(1, a)
    label_pos = pos[:, :, 1:]
    in_seq = (label_pos < lengths[:, None, None]) & valid[:, :, None]
    labels = tokens.gather(1, label_pos.clamp(max=L - 1).reshape(b, -1)).reshape(b, K, B - 1)
    labels = labels.masked_fill(~in_seq, -100)
    ctx_pos = torch.arange(L, device=dev)
    ctx_visible = ctx_pos[None, None, :] < a[:, :, None]  # [b, K, L]
    ctx_visible = ctx_visible[:, :, None, :].expand(b, K, B, L).reshape(b, K * B, L)
    block_of = torch.arange(K, device=dev).repeat_interleave(B)
    same_block = block_of[:, None] == block_of[None, :]
    noise_visible = same_block[None].expand(b, -1, -1) & valid.repeat_interleave(B, dim=1)[:, None, :]
    mask = torch.cat([ctx_visible, noise_visible], dim=-1)
    # padded anchors: let them see themselves so no attention row is empty
    eye = torch.zeros(K * B, L + K * B, dtype=torch.bool, device=dev)
    eye[torch.arange(K * B, device=dev), L + torch.arange(K * B, device=dev)] = True
    mask |= eye[None]
    position_ids = torch.cat([ctx_pos[None].expand(b, L), pos.reshape(b, K * B)], dim=1)
    return {
        "block_ids": block_ids.reshape(b, K * B),
        "position_ids": position_ids,
        "attention_mask": mask[:, None],
        "labels": labels,
    }
