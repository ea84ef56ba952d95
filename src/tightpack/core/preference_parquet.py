"""Packed preference Parquet: packs of whole preference units (pairs, KTO samples, groups), written
and read back.

One row is one pack, laid out as the model reads it (`tightpack.core.preference_layout`), so a reader
gets back exactly the row a collator would build from the same units:

========================  ==============  ===========================================================
column                    type            content (one row = one pack)
========================  ==============  ===========================================================
``input_ids``             list<int32>     the row's tokens, alignment tails included
``loss_mask``             list<int8>      label-aligned: 1 at ``t`` when ``input_ids[t + 1]`` is a
                                          target there
``sequence_start``        list<int32>     where each THD sequence starts (a branch for ``pairs``, a
                                          unit for ``shared-prefix``), alignment included
``sequence_length``       list<int32>     the real tokens of each THD sequence
``sample_index``          list<int64>     the source row of each unit
``branch_index``          list<int32>     per branch, its place in its unit (0 = ``chosen``); a unit
                                          starts at every 0
``branch_prompt_length``  list<int32>     per branch, its unit's prompt tokens
``branch_start``          list<int32>     per branch, where its own tokens start in the row; its
                                          prompt is the ``branch_prompt_length`` tokens before
``branch_length``         list<int32>     per branch, its own tokens
``branch_label``          list<bool>      KTO only: desirable or not
``branch_reward``         list<float>     groups with rewards only
``branch_advantage``      list<float>     groups with advantages only
========================  ==============  ===========================================================

The schema's metadata (key ``tightpack.preference``) records the kind, the layout and the alignment
multiple. There is deliberately no ``seq_start_id``: Megatron-Bridge's SFT reader would train every
branch, ``rejected`` ones included, as an SFT target; without the column it refuses the files
("missing required columns").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tightpack.core.checksums import file_digest
from tightpack.core.pack_plan import PackPlan
from tightpack.core.packed_index import flat_list_column
from tightpack.core.preference_layout import lay_out_units
from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits, concatenated_ranges, unit_sizes
from tightpack.errors import TightpackError

SCHEMA_KEY = b"tightpack.preference"
PER_BRANCH_COLUMNS = {"labels": "branch_label", "rewards": "branch_reward", "advantages": "branch_advantage"}
_CHUNK_TOKENS = 1 << 22  # tokens laid out per step


@dataclass(frozen=True)
class PreferenceFiles:
    """What the schema of packed preference Parquet records: the row ``kind`` (``preference``,
    ``kto``, ``groups``), the ``layout``, the alignment ``multiple`` and the ``pad_id`` of the tails."""

    kind: str
    layout: Layout
    multiple: int
    pad_id: int

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def of_file(cls, path: str | Path) -> PreferenceFiles | None:
        """What ``path`` records, or None when it is not packed preference Parquet (or not readable
        Parquet at all: the readers of SFT packs name that fault)."""
        try:
            metadata = pq.read_schema(path).metadata or {}
        except (OSError, pa.ArrowException):
            return None
        if SCHEMA_KEY not in metadata:
            return None
        values = json.loads(metadata[SCHEMA_KEY])
        if values.get("layout") not in LAYOUTS:
            raise TightpackError(f"{path}: unknown preference layout {values.get('layout')!r}")
        return cls(str(values["kind"]), values["layout"], int(values["multiple"]), int(values["pad_id"]))


def _lists(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
    values = np.ascontiguousarray(values)
    if values.dtype == bool:  # Arrow packs booleans into bits: no zero-copy view of numpy's bytes
        flat = pa.array(values, type=pa.bool_())
    else:
        flat = pa.Array.from_buffers(
            pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)]
        )
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat)


def packs_table(units: PreferenceUnits, pack_offsets: np.ndarray, files: PreferenceFiles) -> pa.Table:
    """The rows of consecutive packs: ``units`` in pack order, pack ``p`` holding units
    ``pack_offsets[p]:pack_offsets[p + 1]``."""
    row = lay_out_units(units, files.layout, pad_to_multiple_of=files.multiple, pad_token_id=files.pad_id)
    branch_offsets = units.unit_offsets[pack_offsets]
    sequence_offsets = branch_offsets if files.layout == "pairs" else pack_offsets
    token_offsets = row.sequence_starts[sequence_offsets]
    sequence_start = row.sequence_starts[:-1] - np.repeat(token_offsets[:-1], np.diff(sequence_offsets))
    branch_start = row.branch_starts - np.repeat(token_offsets[:-1], np.diff(branch_offsets))
    prompt_of_branch = units.prompt_lengths[units.branch_unit]
    columns: dict[str, pa.Array] = {
        "input_ids": _lists(token_offsets, row.tokens.astype(np.int32)),
        "loss_mask": _lists(token_offsets, row.trained.astype(np.int8)),
        "sequence_start": _lists(sequence_offsets, sequence_start.astype(np.int32)),
        "sequence_length": _lists(sequence_offsets, row.sequence_lengths.astype(np.int32)),
        "sample_index": _lists(pack_offsets, units.source_index.astype(np.int64)),
        "branch_index": _lists(branch_offsets, units.branch_index.astype(np.int32)),
        "branch_prompt_length": _lists(branch_offsets, prompt_of_branch.astype(np.int32)),
        "branch_start": _lists(branch_offsets, branch_start.astype(np.int32)),
        "branch_length": _lists(branch_offsets, units.branch_lengths.astype(np.int32)),
    }  # fmt: skip
    for name, value in units.per_branch().items():
        columns[PER_BRANCH_COLUMNS[name]] = _lists(branch_offsets, value)
    table = pa.Table.from_arrays(list(columns.values()), names=list(columns))
    return table.replace_schema_metadata({SCHEMA_KEY: files.to_bytes()})


def write_preference_parquet(
    units: PreferenceUnits,
    plan: PackPlan,
    directory: str | Path,
    files: PreferenceFiles,
    *,
    row_group_size: int,
    packs_per_file: int = 100_000,
    on_packs: Callable[[int], None] | None = None,
) -> list[dict]:
    """Write the packs of ``plan`` (over ``units``) as ``packs-NNNNN.idx.parquet`` in ``directory``.

    Returns one entry per file: ``{"name", "rows", "bytes", "sha256"}``. Packs are laid out a chunk of
    about 4M tokens at a time.
    """
    sizes = plan.pack_loads(unit_sizes(units, files.layout, files.multiple))
    ends = np.cumsum(sizes)
    written = []
    for number, file_first in enumerate(range(0, len(plan), packs_per_file)):
        file_stop = min(file_first + packs_per_file, len(plan))
        path = Path(directory) / f"packs-{number:05d}.idx.parquet"
        writer = None
        first = file_first
        while first < file_stop:
            base = ends[first - 1] if first else 0
            stop = int(np.searchsorted(ends, base + _CHUNK_TOKENS, side="right"))
            stop = min(max(stop, first + 1), file_stop)
            lo, hi = plan.offsets[first], plan.offsets[stop]
            table = packs_table(units.select(plan.order[lo:hi]), plan.offsets[first : stop + 1] - lo, files)
            if writer is None:
                writer = pq.ParquetWriter(
                    path, table.schema, compression="zstd", use_dictionary=False, write_statistics=False
                )
            writer.write_table(table, row_group_size=row_group_size)
            if on_packs is not None:
                on_packs(stop - first)
            first = stop
        writer.close()
        written.append({"name": path.name, "rows": file_stop - file_first, **file_digest(path)})
    return written


@dataclass(frozen=True)
class PreferenceRows:
    """Consecutive packed preference rows as flat columns: ``values[name]`` and ``offsets[name]``
    (``[rows + 1]``, over that column's values)."""

    values: dict[str, np.ndarray]
    offsets: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.offsets["input_ids"]) - 1

    @classmethod
    def from_table(cls, table: pa.Table) -> PreferenceRows:
        values, offsets = {}, {}
        for name in table.column_names:
            flat, lengths = flat_list_column(table.column(name))
            values[name] = flat
            offsets[name] = np.concatenate([[0], np.cumsum(lengths)])
        return cls(values, offsets)

    def units(self, first: int, stop: int | None = None) -> PreferenceUnits:
        """The units of packs ``first:stop`` (of pack ``first`` alone by default), one after another:
        laid out again in the files' layout and alignment they give the stored rows back (`tightpack
        verify` checks that)."""
        stop = first + 1 if stop is None else stop

        def flat(name: str, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
            lo, hi = self.offsets[name][first], self.offsets[name][stop]
            return self.values[name][lo:hi].astype(dtype, copy=False), self.offsets[name][
                first : stop + 1
            ] - lo

        tokens, token_offsets = flat("input_ids")
        trained, _ = flat("loss_mask", np.int8)
        index, branch_offsets = flat("branch_index")
        starts = flat("branch_start")[0] + np.repeat(token_offsets[:-1], np.diff(branch_offsets))
        lengths, prompts = flat("branch_length")[0], flat("branch_prompt_length")[0]
        unit_first = np.flatnonzero(index == 0)
        counts = np.diff(np.append(unit_first, len(index)))
        unit_prompts = prompts[unit_first]
        branches = concatenated_ranges(starts, lengths)
        per_branch = {
            name: flat(column, bool if name == "labels" else np.float32)[0]
            for name, column in PER_BRANCH_COLUMNS.items()
            if column in self.values
        }
        return PreferenceUnits(
            prompt_tokens=tokens[concatenated_ranges(starts[unit_first] - unit_prompts, unit_prompts)],
            prompt_offsets=np.concatenate([[0], np.cumsum(unit_prompts)]),
            branch_tokens=tokens[branches],
            branch_loss_mask=trained[branches - 1],
            branch_offsets=np.concatenate([[0], np.cumsum(lengths)]),
            unit_offsets=np.concatenate([[0], np.cumsum(counts)]),
            source_index=flat("sample_index")[0],
            **per_branch,
        )


class PreferencePacks:
    """Random access to the packs of packed preference Parquet shards (read a row group at a time,
    the last one kept).

    Args:
        files: the shards, in order.
    """

    def __init__(self, files: list[str]) -> None:
        self.files = list(files)
        described = {PreferenceFiles.of_file(file) for file in self.files}
        if None in described:
            plain = [file for file in self.files if PreferenceFiles.of_file(file) is None]
            raise TightpackError(
                f"{plain[0]} is not packed preference Parquet (tightpack pack --format preference|kto|groups "
                "writes it); for SFT packs use PackedDataset"
            )
        if len(described) != 1:
            raise TightpackError(
                f"the shards record different preference settings: {sorted(map(str, described))}"
            )
        self.description: PreferenceFiles = described.pop()
        groups = []  # (file, row group, first row)
        first = 0
        for number, file in enumerate(self.files):
            metadata = pq.ParquetFile(file).metadata
            for group in range(metadata.num_row_groups):
                groups.append((number, group, first))
                first += metadata.row_group(group).num_rows
        self.rows = first
        self._groups = groups
        self._group_first = np.array([g[2] for g in groups] + [first], dtype=np.int64)
        self._cached: tuple[int, PreferenceRows] | None = None
        self._handles: dict[int, pq.ParquetFile] = {}

    def __len__(self) -> int:
        return self.rows

    @property
    def row_groups(self) -> int:
        """Row groups over all shards (`group` reads one)."""
        return len(self._groups)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cached"], state["_handles"] = None, {}  # reopened in the process that reads
        return state

    def group(self, group: int) -> PreferenceRows:
        """Row group ``group`` (counted over all shards), decoded."""
        if self._cached is None or self._cached[0] != group:
            number, in_file, _ = self._groups[group]
            if number not in self._handles:
                self._handles[number] = pq.ParquetFile(self.files[number])
            self._cached = (group, PreferenceRows.from_table(self._handles[number].read_row_group(in_file)))
        return self._cached[1]

    def units(self, index: int) -> PreferenceUnits:
        """The units of pack ``index``."""
        if not 0 <= index < self.rows:
            raise IndexError(f"pack {index} is out of range for {self.rows} packs")
        group = int(np.searchsorted(self._group_first, index, side="right")) - 1
        return self.group(group).units(index - int(self._group_first[group]))
