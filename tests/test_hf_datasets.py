"""Packs as Hugging Face datasets both ways: TRL's packed datasets in, tightpack's packs out."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tightpack import from_hf_packed, to_hf_dataset
from tightpack.cli import main
from tightpack.errors import TightpackError
from tightpack.offline.config import PackConfig
from tightpack.offline.pipeline import pack_dataset
from tightpack.runtime.dataset import PackedDataset
from tightpack.runtime.hf_trainer import PackingCollator

datasets = pytest.importorskip("datasets")


def trl_packs(rng: np.random.Generator, samples: int, pack_size: int) -> list[dict]:
    """Samples with the completion_mask of completion-only loss (1 on the tokens that are targets),
    packed by TRL's own pack_dataset (strategy "bfd": input_ids, completion_mask, seq_lengths)."""
    from trl import pack_dataset as trl_pack

    unpacked = []
    for _ in range(samples):
        n = int(rng.integers(2, 40))
        unpacked.append(
            {
                "input_ids": rng.integers(3, 1000, n).tolist(),
                "completion_mask": [int(k >= n // 2) for k in range(n)],
            }
        )
    packed = trl_pack(datasets.Dataset.from_list(unpacked), seq_length=pack_size, strategy="bfd")
    assert packed.column_names == ["input_ids", "completion_mask", "seq_lengths"]
    return packed.to_list()


def expected_targets(row: dict) -> list[list[int]]:
    """What TRL's padding-free collator trains on, per sequence: the tokens after the first with mask 1."""
    out, start = [], 0
    for n in row["seq_lengths"]:
        ids, mask = row["input_ids"][start : start + n], row["completion_mask"][start : start + n]
        out.append([token for token, keep in zip(ids[1:], mask[1:], strict=True) if keep])
        start += n
    return out


def test_a_trl_packed_dataset_trains_on_the_same_targets(tmp_path, gpt2):
    rows = trl_packs(np.random.default_rng(0), 40, pack_size=160)
    assert any(len(row["seq_lengths"]) > 1 for row in rows)
    out = from_hf_packed(datasets.Dataset.from_list(rows), tmp_path / "packs", pack_size=160)
    assert main(["verify", str(out)]) == 0
    packs = PackedDataset(out)
    collator = PackingCollator(gpt2)
    for index, row in enumerate(rows):
        batch = collator([packs[index]])
        bounds = batch["cu_seq_lens_q"].tolist()
        assert [b - a for a, b in itertools.pairwise(bounds)] == [n - 1 for n in row["seq_lengths"]]
        got = [batch["shift_labels"][0, a:b] for a, b in itertools.pairwise(bounds)]
        assert [t[t != -100].tolist() for t in got] == expected_targets(row)
    # position_ids instead of seq_lengths: the same files
    by_positions = [
        {key: r[key] for key in ("input_ids", "completion_mask")}
        | {"position_ids": [k for n in r["seq_lengths"] for k in range(n)]}
        for r in rows
    ]
    again = from_hf_packed(by_positions, tmp_path / "again", pack_size=160)
    assert (again / "packs-00000.idx.parquet").read_bytes() == (out / "packs-00000.idx.parquet").read_bytes()


def test_trl_rows_are_checked(tmp_path):
    with pytest.raises(TightpackError, match="neither seq_lengths nor position_ids"):
        from_hf_packed([{"input_ids": [1, 2, 3]}], tmp_path / "a", pack_size=8)
    with pytest.raises(TightpackError, match="must be at least 2 and sum to its 3 tokens"):
        from_hf_packed([{"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}], tmp_path / "b", pack_size=8)
    with pytest.raises(TightpackError, match="over pack_size 2"):
        from_hf_packed([{"input_ids": [1, 2, 3, 4], "seq_lengths": [4]}], tmp_path / "c", pack_size=2)


def test_tightpack_packs_as_a_dataset_give_the_collator_the_same_batch(tmp_path, gpt2, chat_rows):
    pack_dataset(chat_rows, tmp_path / "packs", PackConfig(packed_sequence_size=512), tokenizer=gpt2)
    table, packs = to_hf_dataset(tmp_path / "packs"), PackedDataset(tmp_path / "packs")
    assert table.column_names == ["input_ids", "loss_mask", "seq_start_id", "seq_len"] and len(table) == len(
        packs
    )
    collator = PackingCollator(gpt2)
    ours, theirs = collator([packs[i] for i in range(2)]), collator([table[i] for i in range(2)])
    for key in ("input_ids", "position_ids", "labels", "shift_labels", "cu_seq_lens_q"):
        assert torch.equal(ours[key], theirs[key]), key


def test_without_datasets_to_hf_dataset_names_the_extra_that_installs_it(tmp_path):
    """``datasets`` is hidden from a fresh interpreter (``sys.modules`` entry None: import fails)."""
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "from tightpack import to_hf_dataset\n"
        "try:\n    to_hf_dataset('packed')\n"
        "except ImportError as error:\n    print(type(error).__name__, error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.strip() == (
        "ImportError to_hf_dataset needs the datasets package: pip install 'tightpack[hf]' "
        "(or pip install datasets)"
    ), done.stderr
    project = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    hf = re.search(r"^hf = \[(.*?)^\]", project, re.M | re.S).group(1)
    assert re.search(r'^\s*"datasets>=', hf, re.M), hf
