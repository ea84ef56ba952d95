"""What ``tightpack pack`` prints when a run is done: the summary table (samples or preference units),
the mixture, and the next steps (where the output is, and the Megatron-Bridge settings that read it).
"""

from __future__ import annotations

import re

from rich.table import Table

from tightpack.cli import mixture_options as mixing
from tightpack.cli.app import print_bad_rows, stdout
from tightpack.core.stats import bounds_text
from tightpack.offline import pipeline


def print_summary(result, config) -> None:
    """The summary table of a finished run, its bad rows, and its mixture (with weights)."""
    table = Table(title=f"tightpack pack -> {result.output}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = _sample_rows(result) if result.unit_kind is None else _unit_rows(result, config.preference_layout)
    for name, value in rows:
        table.add_row(name, value)
    stdout.print(table)
    print_bad_rows([(bad.location, bad.reason) for bad in result.bad_rows], " (listed in the manifest)")
    if result.mixture is not None:
        stdout.print("\n".join(mixing.mixture_lines(result.mixture)), markup=False, highlight=False)


_TRUNCATION_LABELS = {
    "truncated_prompt_trimmed": "prompt trimmed",
    "truncated_turns_dropped": "turns dropped",
    "truncated_answer_cut": "answer cut",
    "truncated_end_cut": "end cut",
    "truncated_turns_kept": "turns kept (the template merges turns)",
}


def next_steps(result, config, split: str | None = None) -> str:
    """Where the output is and what to run next, for a person at a terminal; the Megatron-Bridge key
    that reads the packs follows ``split`` (a validation split: ``packed_val_data_path``)."""
    folder = result.output
    if result.unit_kind is not None:
        return "\n".join(
            [
                f"output: {folder}",
                f"next:   tightpack verify {folder}",
                f"        tightpack inspect {folder}",
                "training: tightpack.runtime.preference_packs.PackedPreferenceDataset("
                f"{str(folder)!r}) and its collate (docs/preference.md); Megatron-Bridge's SFT reader "
                "refuses these files on purpose",
            ]
        )
    role = split_role(split)
    if role == "train":
        paths = f"packed_train_data_path={folder}, packed_metadata_path={folder / pipeline.METADATA_NAME}"
    elif role == "val":
        paths = f"packed_val_data_path={folder}"
    else:  # a test split or a name that says neither: the reader's choice
        paths = f"packed_train_data_path or packed_val_data_path={folder}"
    notes = []
    if role == "test":
        notes.append("Megatron-Bridge packs no test split (it builds test unpacked)")
    if role != "train" and config.pad_cu_seqlens:
        notes.append(
            "packed_metadata_path: one file whose list covers every split read (concatenate the folders' "
            f"{pipeline.METADATA_NAME} lists)"
        )
    lines = [
        f"output: {folder}",
        f"next:   tightpack verify {folder}" + (f" --cp {config.cp}" if config.cp > 1 else ""),
        f"        tightpack inspect {folder}",
        "Megatron-Bridge: dataset.enable_offline_packing=true, dataset.offline_packing_specs: "
        f"{paths}, packed_sequence_size={config.packed_sequence_size}"
        + (f", pad_seq_to_mult={config.multiple}" if config.multiple > 1 else "")
        + (", pad_cu_seqlens=true" if config.pad_cu_seqlens else "")
        + "".join(f"; {note}" for note in notes),
    ]
    return "\n".join(lines)


_VAL_WORDS = frozenset({"validation", "valid", "val", "dev", "eval", "evaluation"})


def split_role(split: str | None) -> str:
    """What a ``--split`` name is to Megatron-Bridge: ``train`` (also no split), ``val``, ``test``, or
    ``other`` (a name that says neither). Words of the name count: ``validation_matched`` -> ``val``,
    ``test_sft`` -> ``test``, ``train_prefs`` -> ``train``."""
    if split is None:
        return "train"
    words = [word for word in re.split(r"[^a-z0-9]+", split.lower()) if word]
    if any(word in _VAL_WORDS for word in words):
        return "val"
    if any(word.startswith("test") for word in words):
        return "test"
    if any(word.startswith("train") for word in words):
        return "train"
    return "other"


def _plan_rows(result, what: str) -> list[tuple[str, str]]:
    stats = result.stats
    bounds = bounds_text(stats.packs, stats.lower_bound, stats.lower_bound_l2)
    return [
        ("packs (lower bound)", f"{stats.packs:,} ({bounds})"),
        ("efficiency", f"{stats.efficiency:.2%} (at the lower bound: {stats.efficiency_at_bound:.2%})"),
        ("packing factor", f"{stats.packing_factor:.2f} {what}/pack (max {stats.max_samples_per_pack})"),
    ]


def _time_rows(result) -> list[tuple[str, str]]:
    return [
        (
            f"time {stage}",
            f"{seconds:.2f} s"
            + (" (token store reused)" if stage == "tokenize" and result.reused_store else ""),
        )
        for stage, seconds in result.stage_seconds.items()
    ]


def _unit_rows(result, layout: str) -> list[tuple[str, str]]:
    """The summary of a run of preference units (`tightpack.offline.preference`)."""
    counts = result.counts
    return [
        ("rows in", f"{counts['samples_in']:,}"),
        (f"units packed ({result.unit_kind}, {layout})", f"{counts['packed']:,}"),
        ("  branches", f"{counts['branches_packed']:,}"),
        ("  of which truncated", f"{counts['truncated']:,}"),
        *(
            (f"    {label}", f"{counts[key]:,}")
            for key, label in (
                ("truncated_prompt_trimmed", "prompt trimmed"),
                ("truncated_branches_cut", "branches cut"),
            )
            if counts.get(key)
        ),
        ("dropped (too long)", f"{counts['dropped_long']:,}"),
        ("dropped (a cut branch had no supervised token)", f"{counts['no_supervised']:,}"),
        ("bad rows skipped", f"{counts['bad_rows']:,}"),
        ("tokens packed / in (prompts once)", f"{counts['tokens_packed']:,} / {counts['tokens_in']:,}"),
        ("tokens in the layout", f"{counts['layout_tokens']:,}"),
        ("supervised tokens packed / in", f"{counts['supervised_packed']:,} / {counts['supervised_in']:,}"),
        ("alignment padding tokens", f"{counts['alignment_padding']:,}"),
        *_plan_rows(result, "units"),
        *_time_rows(result),
    ]


def _sample_rows(result) -> list[tuple[str, str]]:
    """The summary of a run of SFT samples. Every truncated sample of a run without a mixture is
    packed; a mixture truncates before it chooses, so its truncated samples (by reason) have their own
    line, and under ``packed`` the sequences it packed from truncated samples (every copy)."""
    counts = result.counts
    mixture = result.mixture
    reasons = [(key, label) for key, label in _TRUNCATION_LABELS.items() if counts.get(key)]
    if mixture:
        truncated: list[tuple[str, str]] = [
            ("truncated (before the mixture chose)", f"{counts['truncated']:,}"),
            *((f"  {label}", f"{counts[key]:,}") for key, label in reasons),
        ]
        packed_truncated = sum(source["truncated_packed"] for source in mixture["sources"])
        under_packed = [
            ("  of which repeats (mixture)", f"{counts['mixture_repeats']:,}"),
            ("  of which truncated", f"{packed_truncated:,}"),
            ("left out by the mixture", f"{counts['mixture_left_out']:,}"),
        ]
    else:
        truncated = []
        under_packed = [
            ("  of which truncated", f"{counts['truncated']:,}"),
            *((f"    {label}", f"{counts[key]:,}") for key, label in reasons),
        ]
    return [
        ("samples in", f"{counts['samples_in']:,}"),
        *truncated,
        ("packed", f"{counts['packed']:,}"),
        *under_packed,
        ("dropped (too long)", f"{counts['dropped_long']:,}"),
        ("dropped (no supervised token)", f"{counts['no_supervised']:,}"),
        *(
            (f"  {label}", f"{counts[key]:,}")
            for key, label in (
                ("no_supervised_in_source", "source had none"),
                ("no_supervised_after_truncation", "none left after truncation"),
            )
            if counts.get(key)
        ),
        ("bad rows skipped", f"{counts['bad_rows']:,}"),
        ("tokens packed / in", f"{counts['tokens_packed']:,} / {counts['tokens_in']:,}"),
        ("supervised tokens packed / in", f"{counts['supervised_packed']:,} / {counts['supervised_in']:,}"),
        ("alignment padding tokens", f"{counts['alignment_padding']:,}"),
        *_plan_rows(result, "samples"),
        *_time_rows(result),
    ]
