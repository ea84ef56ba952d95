"""Inputs as `tightpack pack` meets them: packed data given as rows is refused (a packed shard re-read
as pre-tokenized rows would join its sequences into one sample and shift every supervised position by
one), and a null ``loss_mask`` of a pre-tokenized row is no mask (issue 26)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset

from .conftest import run_main, write_jsonl
from .test_cli import error_line


def packed_message(path: Path, layout: str) -> str:
    shown = str(path)
    return (
        f"error: input {shown!r} is packed data ({layout}), not rows: inputs are JSONL or Parquet rows; "
        f"to see the packs run `tightpack inspect {shown}`, to re-pack give the rows they were packed from"
    )


def repack(tmp_path: Path, *args) -> str:
    return error_line(
        run_main(["pack", *args, "-o", "re", "--pack-size", "256", "--workers", "1"], cwd=tmp_path)
    )


@pytest.mark.parametrize("given", ["file", "glob"])
@pytest.mark.parametrize("fmt", ["auto", "tokens"])
def test_a_packed_shard_is_not_an_input(tmp_path, packed_chat, given, fmt):
    shard = sorted(packed_chat.glob("*.parquet"))[0]
    argument = str(shard) if given == "file" else f"{packed_chat}/*.parquet"
    line = repack(tmp_path, argument, "--format", fmt)
    assert line == packed_message(shard, "packed Parquet: a 'seq_start_id' column")
    assert not (tmp_path / "re").exists()


def test_a_megatron_bridge_packed_parquet_is_not_an_input(tmp_path, packed_chat):
    """The reference's layout: ``input_ids``, ``loss_mask``, ``seq_start_id`` and nothing else."""
    table = pq.read_table(sorted(packed_chat.glob("*.parquet"))[0])
    reference = tmp_path / "mb_packed.parquet"
    pq.write_table(table.select(["input_ids", "loss_mask", "seq_start_id"]), reference)
    line = repack(tmp_path, reference, "--format", "tokens")
    assert line == packed_message(reference, "packed Parquet: a 'seq_start_id' column")


def test_a_legacy_packed_npy_is_not_an_input(tmp_path, chat_rows):
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    pack_dataset(
        [source], tmp_path / "npy", PackConfig(packed_sequence_size=128, workers=1, output_format="npy")
    )
    (packs,) = (tmp_path / "npy").glob("*.npy")
    assert repack(tmp_path, packs) == packed_message(packs, "a legacy packed .npy")


def test_pack_dataset_refuses_a_packed_shard(tmp_path, packed_chat):
    shard = sorted(packed_chat.glob("*.parquet"))[0]
    config = PackConfig(packed_sequence_size=256, workers=1)
    with pytest.raises(TightpackError, match=r"is packed data \(packed Parquet: a 'seq_start_id' column\)"):
        pack_dataset([shard], tmp_path / "re", config)
    with pytest.raises(TightpackError, match=r"is packed data"):
        pack_dataset(str(packed_chat / "*.parquet"), tmp_path / "re", config)


def test_pack_dataset_refuses_packs_read_as_a_dataset(tmp_path, packed_chat):
    pytest.importorskip("datasets")
    from tightpack.hf_datasets import to_hf_dataset

    with pytest.raises(TightpackError, match=r"is packed data \(a 'seq_start_id' column: one row per pack\)"):
        pack_dataset(
            to_hf_dataset(packed_chat), tmp_path / "re", PackConfig(packed_sequence_size=256, workers=1)
        )


# --- a null loss_mask ------------------------------------------------------------------------------

IDS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]
MASKS = [[0, 0, 1, 1], None, [0, 1, 1, 1, 1], [1, 1, 1]]  # row 1: null; row 3: a bad row (length)


def packed(tmp_path: Path, name: str, source: Path) -> pa.Table:
    result = run_main(
        ["pack", source, "-o", name, "--pack-size", "64", "--workers", "1", "--skip-bad-lines"], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    return pq.read_table(sorted((tmp_path / name).glob("*.parquet")), columns=["input_ids", "loss_mask"])


def test_a_null_loss_mask_is_no_loss_mask_in_every_input_kind(tmp_path):
    """A Parquet null, a JSONL null and a JSONL row without the key pack to the same bytes: row 1
    all supervised, row 3 (a mask of another length) the only bad row."""
    rows = [{"input_ids": ids, "loss_mask": mask} for ids, mask in zip(IDS, MASKS, strict=True)]
    without = [{key: value for key, value in row.items() if value is not None} for row in rows]
    expected = packed(tmp_path, "without", write_jsonl(tmp_path / "without.jsonl", without))
    parquet = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"input_ids": IDS, "loss_mask": MASKS}), parquet)
    assert packed(tmp_path, "jsonl", write_jsonl(tmp_path / "nulls.jsonl", rows)).equals(expected)
    assert packed(tmp_path, "parquet", parquet).equals(expected)
    # Label-aligned targets, an EOS appended to each: row 0 has 3 (tokens 13, 14, EOS), row 1 all
    # 3 after its first token, row 2 all 5 after its first token.
    assert sum(sum(mask) for mask in expected["loss_mask"].to_pylist()) == 3 + 3 + 5
