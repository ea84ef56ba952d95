"""Real Megatron-Energon datasets and savable loaders for tests/test_energon*.py.

`write_text_dataset` writes WebDataset shards of token-id texts and runs ``energon prepare`` on them;
`savable_loaders` makes Energon savable loaders over them and closes each at the end: a loader with
workers left mid-epoch costs seconds when the garbage collector finally shuts its workers down
(inside whichever test runs then).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_text_dataset(root: Path, tokens: dict[str, list[int]], *, shard_size: int) -> Path:
    """Shards of ``shard_size`` samples (``txt``: the ids joined by spaces), prepared as TextSample."""
    import webdataset

    with webdataset.ShardWriter(str(root / "part-%04d.tar"), maxcount=shard_size, verbose=0) as writer:
        for key, ids in tokens.items():
            writer.write({"__key__": key, "txt": " ".join(map(str, ids))})
    prepare = [sys.executable, "-m", "megatron.energon.cli.main", "prepare", "--non-interactive"]
    options = ["--split-ratio", "1,0,0", "--sample-type", "TextSample", "--no-progress"]
    options += ["--field-map", json.dumps({"text": "txt"}), str(root)]
    subprocess.run(prepare + options, check=True, capture_output=True, timeout=120)
    return root


def savable_loaders(buffer: int, *, repeat: bool) -> Iterator[Any]:
    """A pytest fixture body: yields ``make(path, workers, encoder, repeat=..., **worker_config)``."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    made = []

    def make(path: Path, workers: int, encoder: Any, *, repeat: bool = repeat, **config: Any):
        data = get_train_dataset(
            path,
            batch_size=1,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=encoder,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers, **config),
            packing_buffer_size=buffer,
            repeat=repeat,
        )
        made.append(get_savable_loader(data))
        return made[-1]

    yield make
    for each in made:
        iter(each).close()  # with workers, iter() returns the live epoch iterator
