"""tightpack verify: clean datasets pass; each fault, planted alone, is named with its row."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_jsonl
from tightpack.core.checksums import file_digest
from tightpack.core.legacy_npy import read_legacy_npy, write_legacy_npy
from tightpack.errors import TightpackError
from tightpack.offline.pipeline import PackConfig, pack_dataset
from tightpack.prepare.format_config import FormatConfig
from tightpack.verify import verify_packed

SHARD = "packs-00000.idx.parquet"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A clean tightpack output: m=4, P=256, fixed width, mixed chat lengths, with a truncated sample."""
    folder = tmp_path_factory.mktemp("verify")
    rng = np.random.default_rng(3)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "q " * int(n)},
                {"role": "assistant", "content": "a " * int(k)},
            ]
        }
        for n, k in zip(rng.integers(1, 60, 60), rng.integers(1, 50, 60), strict=True)
    ]
    rows.append(
        {"messages": [{"role": "user", "content": "long " * 400}, {"role": "assistant", "content": "x"}]}
    )
    rows.append({"messages": [{"role": "user", "content": "monologue"}]})  # no supervised token
    source = write_jsonl(folder / "chat.jsonl", rows)
    config = PackConfig(packed_sequence_size=256, pad_seq_to_mult=4, pad_to_max_length=True, workers=1)
    pack_dataset([source], folder / "out", config)
    return folder / "out"


def copy_of(packed: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(packed, target)
    return target


def rewrite(folder: Path, change) -> None:
    """Rewrite the shard with ``change(columns)`` applied, and refresh the manifest's file entry so the
    planted fault is the only one (as a buggy writer would leave it, not a corrupted file)."""
    path = folder / SHARD
    table = pq.read_table(path)
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    change(columns)
    pq.write_table(pa.table(columns), path)
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == SHARD:
            entry.update(file_digest(path), rows=len(columns["input_ids"]))
    (folder / "manifest.json").write_text(json.dumps(manifest))


def faults(report) -> set[str]:
    return set(report.counts)


def test_clean_dataset_passes_and_counts_match_the_manifest(packed):
    report = verify_packed(packed)
    assert report.ok, [str(v) for v in report.violations]
    manifest = json.loads((packed / "manifest.json").read_text())
    assert report.checked["rows"] == manifest["stats"]["packs"]
    assert report.checked["sequences"] == manifest["counts"]["packed"]
    assert report.checked["supervised_tokens"] == manifest["counts"]["supervised_packed"]
    assert report.settings == {"pack_size": 256, "multiple": 4, "cp": None, "pad_to_max_length": True}
    assert "mixture_sources" not in report.checked  # no --weights: no mixture to count again
    assert verify_packed(packed, cp=2).ok  # m=4 = 2*cp, P=256: every segment and the width tail divide


def first_row_with(columns, sequences: int) -> int:
    return next(i for i, starts in enumerate(columns["seq_start_id"]) if len(starts) >= sequences)


def longer_mask(columns, row):
    columns["loss_mask"][row].append(0)


def second_start(columns, row, value):
    columns["seq_start_id"][row][1] = value


ROW_FAULTS = {
    "mask length": (longer_mask, "row", r"loss_mask length \(\d+\) != input_ids length"),
    "first start": (lambda c, r: c["seq_start_id"][r].__setitem__(0, 1), "row", "must start with 0, got 1"),
    "empty starts": (lambda c, r: c["seq_start_id"][r].clear(), "row", r"must start with 0 \(it is empty\)"),
    "start beyond": (lambda c, r: second_start(c, r, 10**6), "row", r"seq_start_id\[1\]=1000000 >= len"),
    "decreasing": (lambda c, r: second_start(c, r, -3), "row", "not non-decreasing at index 1"),
    "mask value": (lambda c, r: c["loss_mask"][r].__setitem__(0, 2), "mask", "values other than 0 and 1"),
    "unshifted mask": (
        lambda c, r: c["loss_mask"][r].__setitem__(c["seq_start_id"][r][1] - 1, 1),
        "mask",
        "not label-aligned",
    ),
}


@pytest.mark.parametrize("name", ROW_FAULTS)
def test_each_row_fault_is_named_with_its_row(packed, tmp_path, name):
    change, check, message = ROW_FAULTS[name]
    folder = copy_of(packed, tmp_path)
    holder = {}

    def plant(columns):
        holder["row"] = first_row_with(columns, 2)
        change(columns, holder["row"])

    rewrite(folder, plant)
    report = verify_packed(folder)
    assert check in faults(report), (name, [str(v) for v in report.violations])
    named = [v for v in report.violations if v.check == check]
    assert named[0].row == holder["row"] and named[0].file == SHARD
    assert any(re.search(message, v.message) for v in named), [str(v) for v in named]
    assert faults(report) <= {check, "manifest", "metadata", "coverage", "width"}  # knock-on effects only


def test_supervised_alignment_padding_is_named(packed, tmp_path):
    folder = copy_of(packed, tmp_path)

    def plant(columns):
        for row, lengths in enumerate(columns["seq_len"]):
            for seq, real in enumerate(lengths):
                start = columns["seq_start_id"][row][seq]
                end = (columns["seq_start_id"][row] + [len(columns["input_ids"][row])])[seq + 1]
                if real < end - start - 2:  # a sequence with at least two padding positions
                    columns["loss_mask"][row][start + real] = 1
                    return

    rewrite(folder, plant)
    report = verify_packed(folder)
    assert {v.check for v in report.violations} == {"mask", "manifest"}  # the supervised count changed too
    assert any("alignment padding tokens after seq_len" in v.message for v in report.violations)


def test_width_alignment_and_cp_faults(packed, tmp_path):
    too_wide = verify_packed(packed, pack_size=128)
    assert "width" in faults(too_wide) and "above the pack size 128" in too_wide.violations[0].message
    misaligned = verify_packed(packed, multiple=8)
    assert "alignment" in faults(misaligned)
    assert "not a multiple of the alignment multiple 8" in misaligned.violations[0].message
    cp4 = verify_packed(packed, cp=4)  # segments are multiples of 4, not of 2 * 4
    assert {"cp"} <= faults(cp4) and "not divisible by 2 * cp = 8" in cp4.violations[0].message


def test_metadata_that_disagrees_with_the_rows(packed, tmp_path):
    folder = copy_of(packed, tmp_path)
    metadata = json.loads((folder / "metadata.json").read_text())
    metadata[0]["max_samples_per_bin"] -= 1
    (folder / "metadata.json").write_text(json.dumps(metadata))
    report = verify_packed(folder)
    assert faults(report) == {"metadata"}
    assert "max_samples_per_bin" in report.violations[0].message


@pytest.mark.parametrize(
    ("key", "value"), [("packed_sequence_size", "4096"), ("pad_seq_to_mult", "4"), ("pad_seq_to_mult", 0)]
)
def test_a_setting_of_the_wrong_kind_is_named_not_a_traceback(packed, tmp_path, key, value):
    """The settings the row checks take from the manifest, edited to what no run writes: one manifest
    fault naming it, the rows still checked."""
    folder = copy_of(packed, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["settings"][key] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    report = verify_packed(folder)
    assert [v.check for v in report.violations] == ["manifest"], [str(v) for v in report.violations]
    assert report.violations[0].message.startswith(f"settings.{key} is {value!r} in the manifest, not a")
    assert report.checked["rows"] == manifest["stats"]["packs"]


def test_manifest_checksums_and_files(packed, tmp_path):
    folder = copy_of(packed, tmp_path)
    shutil.copy(folder / SHARD, folder / "packs-00001.idx.parquet")  # a shard left over from another run
    report = verify_packed(folder)
    leftover = [v for v in report.violations if v.check == "manifest"]
    assert leftover[0].file == "packs-00001.idx.parquet" and "not in the manifest" in leftover[0].message
    (folder / "packs-00001.idx.parquet").unlink()

    with (folder / SHARD).open("r+b") as handle:  # same size, other bytes: a page changed after packing
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    report = verify_packed(folder)
    by_check = {}
    for violation in report.violations:
        by_check.setdefault(violation.check, violation)
    assert set(by_check) == {"read", "manifest"}  # the manifest counts also miss the unread rows
    assert (
        by_check["read"].file == SHARD and "cannot decode row group 0 (rows 0.." in by_check["read"].message
    )
    assert "sha256 differs from the manifest" in by_check["manifest"].message
    assert report.checked["unreadable_rows"] > 0


@pytest.mark.parametrize(("key", "state"), [("stats", "missing"), ("counts", "a list, not an object")])
def test_a_deleted_or_replaced_manifest_section_is_named(packed, tmp_path, key, state):
    def change(manifest):
        if state == "missing":
            del manifest[key]
        else:
            manifest[key] = []

    report = verify_packed(with_manifest(packed, tmp_path, change))
    messages = [v.message for v in report.violations if v.check == "manifest"]
    assert any(f"the manifest's {key} section is {state}" in m for m in messages), report.to_dict()


def test_a_folder_whose_every_shard_is_gone_names_them_from_the_manifest(packed, tmp_path):
    folder = copy_of(packed, tmp_path)
    (folder / SHARD).unlink()
    report = verify_packed(folder)
    assert not report.ok
    assert [(v.check, v.file, v.message) for v in report.violations] == [
        ("manifest", SHARD, "the manifest lists this file but it is missing")
    ]
    cli = [sys.executable, "-m", "tightpack.cli", "verify", str(folder)]
    said = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert said.returncode == 1 and said.stdout.splitlines()[-1] == f"FAILED: 1 faults in {folder}"
    (folder / "manifest.json").unlink()  # nothing left to say what was there: an error, as for any path
    with pytest.raises(TightpackError, match="No Parquet files found"):
        verify_packed(folder)


def test_coverage_duplicates_and_missing_samples(packed, tmp_path):
    folder = copy_of(packed, tmp_path)

    def duplicate(columns):
        row = first_row_with(columns, 2)
        columns["sample_index"][row][1] = columns["sample_index"][row][0]

    rewrite(folder, duplicate)
    report = verify_packed(folder)
    assert faults(report) == {"coverage"}
    messages = [v.message for v in report.violations]
    assert any("is packed twice" in m for m in messages)
    assert any("neither packed nor accounted for" in m for m in messages)


def with_manifest(packed: Path, tmp_path: Path, change) -> Path:
    """A copy of ``packed`` whose manifest is ``change(manifest)``d (the packs untouched)."""
    folder = copy_of(packed, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def packed_rows(packed: Path) -> np.ndarray:
    """Every packed sequence's source row, in pack order."""
    return np.concatenate(
        [np.asarray(row) for row in pq.read_table(packed / SHARD)["sample_index"].to_pylist()]
    )


def test_the_excluded_lists_of_a_clean_output_agree_with_the_packs_and_counts(packed):
    manifest = json.loads((packed / "manifest.json").read_text())
    counts, excluded = manifest["counts"], manifest["excluded"]
    long_row, monologue = 60, 61  # the fixture's truncated row and its row without an answer
    assert excluded["truncated"] == [long_row] and excluded["no_supervised"] == [monologue]
    assert long_row in packed_rows(packed) and monologue not in packed_rows(packed)
    assert counts["truncated"] == 1 and counts["no_supervised"] == 1 and counts["bad_rows"] == 0
    assert verify_packed(packed).ok


def add_rows(manifest: dict, name: str, *rows: int, count: bool = True) -> None:
    """Rows added to ``excluded[name]``, and with ``count`` to ``counts[name]`` (the list the only fault)."""
    manifest["excluded"][name].extend(rows)
    if count:
        manifest["counts"][name] += len(rows)


def set_count(manifest: dict, **counts: int) -> None:
    manifest["counts"].update(counts)


def truncated_reason(manifest: dict) -> str:
    return next(reason for reason, rows in manifest["excluded"]["truncated_by_reason"].items() if rows)


def packed_as_too_long(m: dict) -> None:
    add_rows(m, "dropped_long", 0)


def packed_without_supervision(m: dict) -> None:
    add_rows(m, "no_supervised", 1, 2)
    set_count(m, no_supervised_in_source=3)


def packed_bad_row(m: dict) -> None:
    m["bad_rows"].append({"sample_index": 0, "location": "chat.jsonl:1", "reason": "planted"})
    set_count(m, bad_rows=1)


def truncated_not_packed(m: dict) -> None:
    m["excluded"]["truncated"] = [61]  # the row without an answer, in no_supervised and no pack


def in_two_exclusive_lists(m: dict) -> None:
    add_rows(m, "dropped_long", 61)  # also in no_supervised


def truncated_under_no_reason(m: dict) -> None:
    reason = truncated_reason(m)
    m["excluded"]["truncated_by_reason"][reason] = []
    set_count(m, **{f"truncated_{reason}": 0})


def lost_to_truncation_only(m: dict) -> None:
    """Row 61 moved from no_supervised to no_supervised_after_truncation, counts to match."""
    m["excluded"]["no_supervised"] = []
    m["excluded"]["no_supervised_after_truncation"] = [61]
    set_count(m, no_supervised=0, no_supervised_after_truncation=1, no_supervised_in_source=-1)


def listed_twice(m: dict) -> None:
    add_rows(m, "no_supervised", 61)
    set_count(m, no_supervised_in_source=2)


EXCLUDED_FAULTS = {
    "packed row dropped as too long": (
        packed_as_too_long,
        r"^excluded\.dropped_long lists 1 row \(0\) that the packs hold \(source row 0 in pack row \d+\): "
        "a row dropped as longer than the cap is never packed",
    ),
    "packed row without supervision": (
        packed_without_supervision,
        r"^excluded\.no_supervised lists 2 rows \(1, 2\) that the packs hold",
    ),
    "packed bad row": (
        packed_bad_row,
        r"^bad_rows lists 1 row \(0\) that the packs hold .*: a bad row .* is never",
    ),
    "truncated row not packed": (
        truncated_not_packed,
        r"^excluded\.truncated lists 1 row \(61\) that the packs do not hold: a truncated sample is kept, "
        "so packed",
    ),
    "count of a list": (
        lambda m: set_count(m, no_supervised=2),
        r"^counts\.no_supervised is 2, excluded\.no_supervised lists 1 row: the count is the list's length",
    ),
    "count of a reason": (
        lambda m: set_count(m, **{f"truncated_{truncated_reason(m)}": 3}),
        r"^counts\.truncated_\w+ is 3, excluded\.truncated_by_reason\.\w+ lists 1 row: the count is",
    ),
    "count of bad rows": (
        lambda m: set_count(m, bad_rows=2),
        r"^counts\.bad_rows is 2, bad_rows lists 0 rows",
    ),
    "count of rows without supervision in the source": (
        lambda m: set_count(m, no_supervised_in_source=0),
        r"^counts\.no_supervised_in_source is 0, excluded\.no_supervised less "
        r"excluded\.no_supervised_after_truncation is 1 row",
    ),
    "row in two lists that exclude each other": (
        in_two_exclusive_lists,
        r"^excluded\.dropped_long and excluded\.no_supervised both list 1 row \(61\): a run puts a row in "
        "one of them at most",
    ),
    "truncated row under no reason": (
        truncated_under_no_reason,
        r"^excluded\.truncated lists 1 row \(60\) that excluded\.truncated_by_reason does not",
    ),
    "row lost to truncation not without supervision": (
        lost_to_truncation_only,
        r"^excluded\.no_supervised_after_truncation lists 1 row \(61\) missing from excluded\.no_supervised",
    ),
    "row past the source": (
        lambda m: add_rows(m, "dropped_long", 10**6),
        r"^excluded\.dropped_long lists 1 row \(1000000\) outside the source rows 0\.\.61",
    ),
    "row listed twice": (listed_twice, r"^excluded\.no_supervised lists 1 row \(61\) more than once"),
    "not a list of rows": (
        lambda m: m["excluded"].update(dropped_long="none"),
        r"^excluded\.dropped_long is not a list of source rows",
    ),
}
"""(change of the manifest, the message of the ``excluded`` fault it plants): the packs untouched."""


@pytest.mark.parametrize("name", EXCLUDED_FAULTS)
def test_each_excluded_fault_is_named_with_its_list_and_rows(packed, tmp_path, name):
    change, message = EXCLUDED_FAULTS[name]
    report = verify_packed(with_manifest(packed, tmp_path, change))
    named = [v for v in report.violations if v.check == "excluded"]
    assert any(re.search(message, v.message) for v in named), (name, [str(v) for v in report.violations])
    assert all("(the manifest or the packs changed after packing)" in v.message for v in named)
    # a row taken off no_supervised is neither packed nor accounted for: coverage's knock-on effect
    assert faults(report) <= {"excluded", "coverage"}, [str(v) for v in report.violations]


def test_a_packed_row_listed_as_excluded_names_the_pack_row_holding_it(packed, tmp_path):
    report = verify_packed(with_manifest(packed, tmp_path, lambda m: add_rows(m, "dropped_long", 5)))
    assert report.counts == {"excluded": 1}, [str(v) for v in report.violations]
    violation = report.violations[0]
    table = pq.read_table(packed / SHARD)["sample_index"].to_pylist()
    assert 5 in table[violation.row] and f"in pack row {violation.row}" in violation.message
    assert not any(5 in indices for indices in table[: violation.row])  # the first pack row that holds it


def test_cli_fails_on_a_tampered_excluded_list(packed, tmp_path):
    folder = with_manifest(packed, tmp_path, lambda m: add_rows(m, "dropped_long", 0, count=False))
    command = [sys.executable, "-m", "tightpack.cli", "verify", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(
        line.startswith("[excluded] row ") and "excluded.dropped_long lists 1 row (0)" in line
        for line in lines
    )
    assert any("counts.dropped_long is 0, excluded.dropped_long lists 1 row" in line for line in lines)
    assert lines[-1].startswith("FAILED: 2 faults")


def test_a_preference_pack_checks_its_dropped_rows(tmp_path):
    """Preference runs list their dropped units' rows in ``excluded`` and, with the reason of each, in
    ``excluded.dropped_reasons``: none of them packed, and the two agree."""
    rows = [
        {"prompt": f"Question {i}: what is {i} + {i}?", "chosen": f" {2 * i}.", "rejected": "?"}
        for i in range(12)
    ]
    rows.append({"prompt": "long " * 400, "chosen": " yes", "rejected": " no"})
    source = write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = PackConfig(
        packed_sequence_size=128, long_samples="drop", format=FormatConfig(format="preference"), workers=1
    )
    folder = pack_dataset([source], tmp_path / "out", config).output
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["excluded"]["dropped_long"] == [12] and list(manifest["excluded"]["dropped_reasons"]) == [
        "12"
    ]
    assert verify_packed(folder).ok

    def packed_and_dropped(m):
        m["excluded"]["dropped_reasons"]["3"] = "planted"

    report = verify_packed(with_manifest(folder, tmp_path / "tampered", packed_and_dropped))
    assert report.counts == {"excluded": 2}, [str(v) for v in report.violations]
    first, second = (v.message for v in report.violations)
    assert first.startswith("excluded.dropped_reasons lists 1 row (3) that the packs hold")
    assert second.startswith(
        "excluded.dropped_reasons lists 1 row (3) missing from excluded.dropped_long and "
        "excluded.no_supervised"
    )


def test_legacy_npy_faults(packed, tmp_path):
    folder = tmp_path / "npy"
    folder.mkdir()
    rows = [
        {key: np.asarray(value) for key, value in row.items()}
        for row in pq.read_table(packed / SHARD).to_pylist()
    ]
    write_legacy_npy(folder / "packs.npy", rows)
    assert verify_packed(folder / "packs.npy", pack_size=256, multiple=4).ok
    rows[1]["seq_start_id"] = rows[1]["seq_start_id"][::-1].copy()
    write_legacy_npy(folder / "packs.npy", rows)
    assert len(read_legacy_npy(folder / "packs.npy")) == len(rows)
    report = verify_packed(folder / "packs.npy", pack_size=256)
    assert report.violations[0].row == 1 and report.violations[0].check == "row"


def test_megatron_bridge_parquet_without_manifest(packed, tmp_path):
    table = pq.read_table(packed / SHARD, columns=["input_ids", "loss_mask", "seq_start_id"])
    pq.write_table(table, tmp_path / "mb.parquet")
    assert verify_packed(tmp_path / "mb.parquet", pack_size=256, multiple=4).ok
    report = verify_packed(tmp_path / "mb.parquet", metadata=packed / "metadata.json")
    assert report.ok and report.settings["pack_size"] == 256


def test_cli_exit_status_and_report(packed, tmp_path):
    def run(*args):
        command = [sys.executable, "-m", "tightpack.cli", "verify", *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    clean = run(packed)
    assert clean.returncode == 0 and clean.stdout.startswith("OK: ") and "sequences" in clean.stdout
    faulty = run(packed, "--cp", 4)
    assert faulty.returncode == 1 and faulty.stdout.splitlines()[-1].startswith("FAILED: ")
    assert faulty.stdout.startswith("[cp] file packs-00000.idx.parquet, row ")
    report = json.loads(run(packed, "--cp", 4, "--json").stdout)
    assert report["ok"] is False and report["counts"]["cp"] > 0 and report["violations"][0]["row"] is not None
    missing = run(tmp_path / "nowhere.parquet")
    assert (
        missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr
    )
