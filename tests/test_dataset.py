"""PackedDataset over real packed files: ours, Megatron-Bridge-style, and legacy .npy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tightpack.core.packed_index import index_key
from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.runtime.collate import PackedCollate
from tightpack.runtime.dataset import PackedDataset

from .conftest import write_jsonl


@pytest.fixture
def packed(packed_chat):
    return packed_chat


def expected_rows(folder):
    return [row for file in sorted(folder.glob("*.parquet")) for row in pq.read_table(file).to_pylist()]


def test_rows_equal_the_parquet_rows(packed, tmp_path):
    dataset = PackedDataset(packed, cache_dir=tmp_path / "cache")
    expected = expected_rows(packed)
    assert len(dataset) == len(expected) > 10
    for index in np.random.default_rng(0).permutation(len(expected)):
        row = dataset[index]
        for key in ("input_ids", "loss_mask", "seq_start_id", "seq_len"):
            assert row[key].tolist() == expected[index][key], (index, key)
    assert dataset[0]["input_ids"].dtype == np.int32 and dataset[0]["loss_mask"].dtype == np.int8


def test_file_folder_and_glob_specs_agree(packed, tmp_path):
    file = next(packed.glob("*.parquet"))
    by_file = PackedDataset(file, cache_dir=tmp_path / "cache")
    by_glob = PackedDataset(str(packed / "*.idx.parquet"), cache_dir=tmp_path / "cache")
    assert len(by_file) == len(by_glob)
    assert by_file[3]["input_ids"].tolist() == by_glob[3]["input_ids"].tolist()


def test_negative_index_is_a_padding_row(packed, tmp_path):
    dataset = PackedDataset(packed, cache_dir=tmp_path / "cache")
    last = dataset[len(dataset) - 1]
    padding = dataset[-1]
    assert padding["input_ids"].tolist() == last["input_ids"].tolist()
    assert last["loss_mask"].any() and not padding["loss_mask"].any()
    assert len(padding["loss_mask"]) == len(last["loss_mask"])
    assert padding["padding_row"] is True and "padding_row" not in last  # what the collate reads
    batch = PackedCollate(pack_size=128, eos_id=50256)([dataset[0], dataset[-1]])
    assert batch["loss_mask"][1].sum() == 0  # a padding row contributes nothing to the loss


def test_epoch_mapping_with_oversampling(packed, tmp_path):
    rows = len(PackedDataset(packed, cache_dir=tmp_path / "cache"))
    dataset = PackedDataset(packed, max_num_samples=2 * rows + 3, seed=5, cache_dir=tmp_path / "cache")
    assert len(dataset) == 2 * rows + 3
    mapping = dataset.mapping
    assert sorted(mapping[:rows]) == list(range(rows)) and sorted(mapping[rows : 2 * rows]) == list(
        range(rows)
    )
    assert not np.array_equal(mapping[:rows], np.arange(rows))
    assert np.array_equal(
        mapping, PackedDataset(packed, max_num_samples=2 * rows + 3, seed=5, cache_dir=tmp_path / "c").mapping
    )
    assert not np.array_equal(
        mapping, PackedDataset(packed, max_num_samples=2 * rows + 3, seed=6, cache_dir=tmp_path / "c").mapping
    )
    direct = PackedDataset(packed, cache_dir=tmp_path / "cache")
    assert dataset[7]["input_ids"].tolist() == direct[int(mapping[7])]["input_ids"].tolist()
    padding = dataset[-1]  # mapped, then zero loss
    assert padding["input_ids"].tolist() == direct[int(mapping[-1])]["input_ids"].tolist()
    assert not padding["loss_mask"].any() and padding["padding_row"] is True


def test_megatron_bridge_style_folder_without_seq_len(tmp_path):
    rows = [
        {"input_ids": [5, 6, 7, 2, 8, 9, 2], "loss_mask": [0, 1, 1, 0, 1, 1, 0], "seq_start_id": [0, 4]},
        {"input_ids": [3, 4, 2], "loss_mask": [1, 1, 0], "seq_start_id": [0]},
    ]
    folder = tmp_path / "mb"
    folder.mkdir()
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("seq_start_id", pa.list_(pa.int64())),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, folder / "training_8.idx.parquet", row_group_size=500)
    dataset = PackedDataset(folder, cache_dir=tmp_path / "cache")
    assert [dataset[i]["input_ids"].tolist() for i in range(2)] == [r["input_ids"] for r in rows]
    assert "seq_len" not in dataset[0]


def test_legacy_npy(packed, tmp_path, chat_rows):
    source = write_jsonl(tmp_path / "c.jsonl", chat_rows)
    pack_dataset(
        [source], tmp_path / "npy", PackConfig(packed_sequence_size=128, output_format="npy", workers=1)
    )
    dataset = PackedDataset(tmp_path / "npy" / "packs.npy")
    assert len(dataset) > 1
    assert not dataset[-1]["loss_mask"].any() and dataset[len(dataset) - 1]["loss_mask"].any()
    assert dataset[-1]["padding_row"] is True and "padding_row" not in dataset[0]


def test_index_is_built_once_and_rebuilt_when_a_shard_changes(packed, tmp_path):
    cache = tmp_path / "cache"
    PackedDataset(packed, cache_dir=cache)[0]
    built = sorted(p.name for p in cache.iterdir())
    PackedDataset(packed, cache_dir=cache)[1]
    assert sorted(p.name for p in cache.iterdir()) == built
    file = next(packed.glob("*.parquet"))
    table = pq.read_table(file)
    pq.write_table(table.slice(0, table.num_rows - 1), file)
    assert index_key([str(file)]) not in built
    dataset = PackedDataset(packed, cache_dir=cache)
    assert len(dataset) == table.num_rows - 1
    assert dataset[0]["input_ids"].tolist() == table.slice(0, 1).to_pylist()[0]["input_ids"]


def test_dataloader_with_worker_processes(packed, tmp_path):
    dataset = PackedDataset(packed, cache_dir=tmp_path / "cache")
    collate = PackedCollate(pack_size=128, eos_id=50256)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=2, collate_fn=collate)
    tokens = [int(batch["loss_mask"].sum()) for batch in loader]
    assert tokens == [int(collate([dataset[i]])["loss_mask"].sum()) for i in range(len(dataset))]


def empty_shard(folder):
    columns = {
        name: pa.array([], pa.list_(pa.int32())) for name in ("input_ids", "loss_mask", "seq_start_id")
    }
    pq.write_table(pa.table(columns), folder / "a.parquet")


def shard_without_mask(folder):
    pq.write_table(pa.table({"input_ids": pa.array([[1]], pa.list_(pa.int32()))}), folder / "a.parquet")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (empty_shard, r"packed dataset '.*data' is empty \(0 rows\)"),
        (shard_without_mask, "is missing required columns: loss_mask, seq_start_id"),
        (lambda folder: None, "No Parquet files found in directory"),
    ],
)
def test_errors(tmp_path, make, message):
    folder = tmp_path / "data"
    folder.mkdir()
    make(folder)
    with pytest.raises(TightpackError, match=message):
        PackedDataset(folder, cache_dir=tmp_path / "cache")


def test_index_out_of_range(packed, tmp_path):
    dataset = PackedDataset(packed, cache_dir=tmp_path / "cache")
    with pytest.raises(IndexError, match=f"out of range for a packed dataset of {len(dataset)} rows"):
        dataset[len(dataset)]
