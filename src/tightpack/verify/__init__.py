"""``tightpack verify``: check that a packed dataset is right, and name every fault with its row.

Works on tightpack output folders, Megatron-Bridge's packed Parquet (files, folders, globs) and legacy
``.npy`` files. Rows are read one row group at a time as flat columns and checked with vectorized
arithmetic, so any size verifies in bounded memory. Checks:

- ``complete``: the folder is not the work folder of an unfinished ``tightpack pack`` run.
- ``read``: every row group decodes (an unreadable one is named and skipped).
- ``row``: the reference's row invariants (docs/contract.md §2.7): loss_mask as long as input_ids,
  seq_start_id non-empty, starting at 0, within the row, non-decreasing; and no empty sequence.
- ``mask``: loss_mask values are 0 or 1, and label-aligned: the last stored token of a sequence has
  nothing to predict, so its mask is 0; with ``seq_len``, the alignment padding is not supervised.
- ``width``: the runtime tokens of a row fit the pack size.
- ``alignment``: every sequence's runtime length is a multiple of the alignment multiple.
- ``cp``: with ``cp`` > 1, every segment, and the trailing width segment of fixed-width packs, is
  divisible by ``2 * cp`` (docs/contract.md §6).
- ``metadata``: metadata.json agrees with the rows (max samples per bin, dataset max length, min
  packed length, pack size, packing factor and efficiency).
- ``manifest``: the manifest's files exist with their sha256, sizes and row counts; its counts agree
  with the rows.
- ``coverage``: with ``sample_index``, no source sample is packed twice and, with a manifest, every
  source row is either packed or accounted for (bad, dropped, no supervised token).
- ``excluded``: the manifest's excluded rows (`tightpack.verify.excluded`): the rows a run never packs
  (dropped, no supervised token, left out by a mixture, bad) are not in the packs, the truncated ones
  are; every count of such a list is its length; lists that exclude each other share no row.
- ``mixture``: a mixture's manifest (``tightpack pack --weights``) holds the figures the rows give, per
  source, window and in ``counts.mixture_repeats``, counted again by the function that counted them
  at pack time (`tightpack.verify.mixture`).
- preference packs (``tightpack pack --format preference|kto|groups``): the checks of
  `tightpack.verify.preference` instead of the row checks above (every unit whole, every row laid out
  again as stored), with the same manifest, metadata and coverage checks.
- ``media``: vision packs (`tightpack.verify.media`): every image and video frame they refer to is
  still inside the media root, decodes, and gives its recorded patch grid (``media=False`` skips it:
  it decodes every picture).
"""

from pathlib import Path

from tightpack.core.pack_manifest import MANIFEST_NAME, METADATA_NAME, read_manifest, read_metadata
from tightpack.core.packed_index import check_shards
from tightpack.core.paths import packed_dataset_files
from tightpack.core.preference_parquet import PreferenceFiles
from tightpack.errors import TightpackError
from tightpack.verify.excluded import check_excluded
from tightpack.verify.folder import check_coverage, check_manifest, check_manifest_files, check_metadata
from tightpack.verify.media import check_media
from tightpack.verify.mixture import check_mixture
from tightpack.verify.preference import check_preference_files, check_preference_manifest
from tightpack.verify.report import VerifyReport, Violation  # noqa: F401 (for the package's own modules; not public API)
from tightpack.verify.rows import Totals, check_rows, npy_rows, parquet_rows


def verify_packed(
    path: str | Path,
    *,
    pack_size: int | None = None,
    multiple: int | None = None,
    cp: int | None = None,
    metadata: str | Path | None = None,
    limit: int = 20,
    media: bool = True,
) -> VerifyReport:
    """Check a packed dataset (a tightpack folder, Megatron-Bridge Parquet, or legacy ``.npy``).

    Settings not given come from the folder's manifest: pack size, alignment multiple, fixed width.
    ``metadata`` defaults to the folder's ``metadata.json``. At most ``limit`` faults are listed per
    check; ``report.counts`` holds the totals. ``media=False`` skips reading the media files of vision
    packs. Unreadable input raises `TightpackError`.

    Example::

        report = verify_packed("packed/", cp=2)
        print(report.ok, report.counts)
    """
    path = Path(path)
    folder = path if path.is_dir() else None
    if folder is not None and (folder / ".pid").is_file():
        report = VerifyReport(str(path), {})
        report.add(
            "complete", "this is the work folder of a `tightpack pack` run that did not finish, not a dataset"
        )
        return report
    manifest, manifest_fault = None, None
    if folder is not None and (folder / MANIFEST_NAME).is_file():
        try:
            manifest = read_manifest(folder / MANIFEST_NAME)
        except TightpackError as error:
            manifest_fault = str(error)
    saved = (manifest or {}).get("settings", {})
    for key in ("packed_sequence_size", "pad_seq_to_mult"):  # what the row checks take from the run
        value = saved.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            saved = {k: v for k, v in saved.items() if k != key}
            manifest_fault = manifest_fault or (
                f"settings.{key} is {value!r} in the manifest, not a positive whole number: the rows are "
                "checked without it (the manifest changed after packing)"
            )
    settings = {
        "pack_size": pack_size or saved.get("packed_sequence_size"),
        "multiple": multiple or saved.get("pad_seq_to_mult"),
        "cp": cp,
        "pad_to_max_length": bool(saved.get("pad_to_max_length", False)),
    }
    entries: list[dict] = []
    metadata_path = Path(metadata) if metadata else (folder / METADATA_NAME if folder else None)
    if metadata_path is not None and metadata_path.is_file():
        entries = read_metadata(metadata_path)
        settings["pack_size"] = (
            settings["pack_size"]
            or max((entry.get("pack_size") or 0 for entry in entries), default=0)
            or None
        )
    elif metadata is not None:
        raise TightpackError(f"metadata file not found: {metadata}")

    report = VerifyReport(str(path), settings, limit=limit)
    try:
        files = packed_dataset_files(path)
    except TightpackError:
        if not (manifest or {}).get("files"):
            raise
        check_manifest_files(folder, manifest, [], report)  # every shard the run wrote is gone: name them
        return report
    read = manifest is not None or manifest_fault is None  # a manifest there but unreadable: False
    if manifest_fault is not None:
        report.add("manifest", manifest_fault)
    described = None if files[0].lower().endswith(".npy") else PreferenceFiles.of_file(files[0])
    if described is not None:
        settings["multiple"] = multiple or described.multiple
        totals = check_preference_files(files, described, settings, report)
        check_metadata(entries, settings, totals, report)
        if manifest is not None:
            check_manifest_files(folder, manifest, files, report)
            check_preference_manifest(manifest, totals, report)
        check_coverage(manifest, totals, report, manifest_read=read)
        if manifest is not None:
            check_excluded(manifest, totals, report)
        report.checked = {
            "files": len(files),
            "rows": totals.rows,
            "unreadable_rows": totals.unread,
            "units": sum(len(part) for part in totals.sample_index),
            "sequences": totals.sequences,
            "tokens": totals.runtime,
            "supervised_tokens": totals.supervised,
        }
        return report
    if not files[0].lower().endswith(".npy"):
        check_shards(files, name=str(path))
    totals = Totals(per_sequence=bool((manifest or {}).get("mixture")))
    for file in files:
        if file.lower().endswith(".npy"):
            batches = npy_rows(file, totals.rows)
        else:
            batches = parquet_rows(file, report, totals)
        for batch in batches:
            check_rows(batch, settings, report, totals)
    check_metadata(entries, settings, totals, report)
    if manifest is not None:
        check_manifest(folder, manifest, files, totals, report)
    check_coverage(manifest, totals, report, manifest_read=read)
    if manifest is not None:
        check_excluded(manifest, totals, report)
    mixture_sources = check_mixture(manifest, totals, report) if manifest is not None else 0
    media_items = (
        check_media(files, manifest, report) if media and not files[0].lower().endswith(".npy") else 0
    )
    report.checked = {
        "files": len(files),
        "rows": totals.rows,
        "unreadable_rows": totals.unread,
        "sequences": totals.sequences,
        "runtime_tokens": totals.runtime,
        "supervised_tokens": totals.supervised,
    }
    if mixture_sources:
        report.checked["mixture_sources"] = mixture_sources
    if media_items:
        report.checked["media_items"] = media_items
    return report
