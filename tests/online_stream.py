"""A restartable sample stream for `OnlinePacker` tests: it records when each sample was read."""

from __future__ import annotations

import torch


class Stream:
    """Samples ``s0000, s0001, ...`` of the given lengths, with distinct tokens; records the packer step
    (``emitted``: packs the consumer has received) at which each was read."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.emitted = 0  # packs the consumer has received so far
        self.arrival: dict[str, int] = {}

    def sample(self, index: int) -> dict:
        n = self.lengths[index]
        ids = torch.arange(n) + 1000 * (index + 1)
        return {"key": f"s{index:04d}", "input_ids": ids, "loss_mask": torch.ones(n)}

    def __call__(self, start: int, stride: int):
        for index in range(start, len(self.lengths), stride):
            sample = self.sample(index)
            self.arrival[sample["key"]] = self.emitted
            yield sample

    def restore(self, key: str) -> dict:
        return self.sample(int(key[1:]))
