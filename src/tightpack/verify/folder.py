"""The file-level checks of ``tightpack verify``: metadata, manifest and coverage against the rows' totals."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tightpack.core.checksums import file_digest
from tightpack.offline.output_folder import METADATA_NAME
from tightpack.verify.excluded import listed_rows
from tightpack.verify.report import VerifyReport
from tightpack.verify.rows import Totals


def check_metadata(
    entries: list[dict], settings: dict[str, Any], totals: Totals, report: VerifyReport
) -> None:
    if not entries or totals.rows == 0:
        return
    actual = {
        "max_samples_per_bin": totals.max_sequences,
        "dataset_max_seqlen": totals.max_length,
        "min_packed_seqlen": totals.min_load,
        "packing_factor": round(totals.sequences / totals.rows, 2),
    }
    pack_size = settings.get("pack_size")
    if pack_size:
        actual["pack_size"] = pack_size
        actual["packing_efficiency"] = round(totals.runtime / (totals.rows * pack_size) * 100, 2)
    if len(entries) == 1:
        for key, value in actual.items():
            if key in entries[0] and entries[0][key] != value:
                report.add("metadata", f"{METADATA_NAME} says {key}={entries[0][key]}, the rows give {value}")
        return
    # Several splits in one file: check what the runtime takes from it (maxima and minimum).
    for key, bound, worse in (
        ("max_samples_per_bin", max, lambda said, real: said < real),
        ("dataset_max_seqlen", max, lambda said, real: said < real),
        ("min_packed_seqlen", min, lambda said, real: said > real),
    ):
        said = bound(entry.get(key, 0) for entry in entries)
        if worse(said, actual[key]):
            report.add(
                "metadata",
                f"{METADATA_NAME} gives {key}={said} over its entries, the rows give {actual[key]}",
            )


def check_manifest(
    folder: Path, manifest: dict, files: list[str], totals: Totals, report: VerifyReport
) -> None:
    check_manifest_files(folder, manifest, files, report)
    stats, counts = (_section(manifest, key, report) for key in ("stats", "counts"))
    for said, actual, what in (
        (stats.get("packs"), totals.rows, "packs"),
        (counts.get("packed"), totals.sequences, "packed sequences"),
        (stats.get("tokens"), totals.runtime, "runtime tokens"),
        (counts.get("supervised_packed"), totals.supervised, "supervised tokens"),
    ):
        if said is not None and said != actual:
            report.add("manifest", f"the manifest counts {said} {what}, the rows hold {actual}")


def _section(manifest: dict, key: str, report: VerifyReport) -> dict:
    """``manifest[key]``, or {} with a violation when it is missing or not an object (its figures would
    go unchecked)."""
    section = manifest.get(key)
    if isinstance(section, dict):
        return section
    state = "missing" if section is None else f"a {type(section).__name__}, not an object"
    report.add(
        "manifest",
        f"the manifest's {key} section is {state}: its figures cannot be checked against the rows "
        "(restore the manifest the run wrote, or pack again)",
    )
    return {}


def check_manifest_files(folder: Path, manifest: dict, files: list[str], report: VerifyReport) -> None:
    """The manifest's files are the folder's, with their recorded sizes and sha256."""
    listed = {entry["name"]: entry for entry in manifest.get("files", [])}
    present = {Path(file).name for file in files}
    for name in sorted(present - set(listed)):
        report.add("manifest", "the file is not in the manifest (left over from another run?)", file=name)
    for name, entry in listed.items():
        path = folder / name
        if not path.is_file():
            report.add("manifest", "the manifest lists this file but it is missing", file=name)
            continue
        digest = file_digest(path)
        for key in ("sha256", "bytes"):
            if key in entry and entry[key] != digest[key]:
                report.add(
                    "manifest", f"{key} differs from the manifest: the file changed after packing", file=name
                )


def allowed_copies(manifest: dict | None) -> int | None:
    """How many times a run may pack one source sample: once, or up to the cap of a mixture run
    (`tightpack.offline.mixture`: ``max_repetitions``, from the mixture section or, where that is
    missing, the run's settings); None when the manifest's cap is not a number of at least 1.

    >>> allowed_copies(None), allowed_copies({"mixture": {"max_repetitions": 2.5}})
    (1, 3)
    >>> allowed_copies({"settings": {"mixture": {"max_repetitions": 3}}})
    3
    >>> allowed_copies({"mixture": {"max_repetitions": "4"}}) is None
    True
    """
    manifest = manifest if isinstance(manifest, dict) else {}
    settings = manifest.get("settings")
    mixture = manifest.get("mixture") or (settings.get("mixture") if isinstance(settings, dict) else None)
    if not mixture:
        return 1
    cap = mixture.get("max_repetitions") if isinstance(mixture, dict) else None
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap) or cap < 1:
        return None
    return math.ceil(cap)


def check_coverage(
    manifest: dict | None, totals: Totals, report: VerifyReport, *, manifest_read: bool = True
) -> None:
    """Every source row packed once (or up to a mixture's cap) or accounted for in the manifest.
    ``manifest_read``: False when a manifest is there but could not be read (a fault of its own): how
    many copies of a sample the run allowed is then unknown, and repeats are not counted."""
    if not totals.sample_index:
        return
    indices = np.concatenate(totals.sample_index)
    rows = np.concatenate(totals.sample_rows)
    order = np.argsort(indices, kind="stable")
    copies = allowed_copies(manifest) if manifest_read else None
    if copies is None:  # a cap that is not a number (the mixture check names it), or no manifest read
        return
    repeated = np.flatnonzero(indices[order][copies:] == indices[order][:-copies]) + copies
    for at in repeated:
        first, again = rows[order[at - copies]], rows[order[at]]
        times = (
            "twice"
            if copies == 1
            else f"{copies + 1} times or more (the mixture repeats it {copies} at most)"
        )
        unknown = "; with no manifest.json no repeat is allowed (a run that mixes repeats samples)"
        report.add(
            "coverage",
            f"source sample {indices[order[at]]} is packed {times} (rows {first} and {again})"
            + (unknown if manifest is None else ""),
            row=int(again),
        )
    if manifest is None:
        return
    counts, excluded = manifest.get("counts"), manifest.get("excluded")
    samples_in = counts.get("samples_in") if isinstance(counts, dict) else None
    if isinstance(samples_in, bool) or not isinstance(samples_in, int) or samples_in < 0:
        return  # the counts check names a count of the wrong kind
    excluded = excluded if isinstance(excluded, dict) else {}
    accounted = np.zeros(samples_in, dtype=bool)
    bad_rows = manifest.get("bad_rows")
    bad = (
        [row.get("sample_index") for row in bad_rows if isinstance(row, dict)]
        if isinstance(bad_rows, list)
        else []
    )
    reasons = ("dropped_long", "no_supervised", "mixture_left_out")
    for listed in (*(excluded.get(reason, []) for reason in reasons), bad):
        rows = listed_rows(listed)  # a list that is not one of source rows is the excluded check's
        if rows is not None:
            accounted[rows[(rows >= 0) & (rows < len(accounted))]] = True
    inside = indices[(indices >= 0) & (indices < len(accounted))]
    outside = indices[(indices < 0) | (indices >= len(accounted))]
    for index in outside[:5]:
        report.add("coverage", f"sample_index {index} is not a source row (the source has {len(accounted)})")
    accounted[inside] = True
    missing = np.flatnonzero(~accounted)
    if len(missing) > 1 and not isinstance(manifest.get("excluded"), dict):
        report.add(
            "coverage",
            f"{len(missing):,} source rows (the first {missing[0]}) are neither packed nor accounted "
            "for: the manifest has no excluded section to list the rows left out (the manifest changed "
            "after packing)",
        )
        return
    for index in missing:
        report.add("coverage", f"source row {index} is neither packed nor accounted for in the manifest")
