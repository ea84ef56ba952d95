"""``tightpack pack``: tokenize, truncate, plan and write packs, with a progress display and a summary."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tightpack.cli import mixture_options as mixing
from tightpack.cli import options
from tightpack.cli.app import (
    DEMO_OUTPUT,
    DEMO_PACK_SIZE,
    OLDEST_TURNS,
    Algorithm,
    Engine,
    Format,
    LongSamples,
    LossOn,
    OutputFormat,
    PreferenceLayout,
    TruncationMethod,
    app,
    print_bad_rows,
    stderr,
    stdout,
)
from tightpack.core.stats import bounds_text
from tightpack.errors import TightpackError
from tightpack.offline import pipeline


def _default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _RichProgress:
    """`tightpack.offline.pipeline.Progress` on a rich progress display (stderr)."""

    def __init__(self, display: Progress) -> None:
        self.display, self.task = display, None

    def begin(self, stage: str, total: int | None) -> None:
        self.task = self.display.add_task(stage, total=total)

    def advance(self, amount: int) -> None:
        self.display.advance(self.task, amount)

    def end(self) -> None:
        completed = self.display.tasks[self.task].completed
        self.display.update(self.task, total=completed, completed=completed)


@app.command()
def pack(
    inputs: options.Inputs = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Output folder (default for the demo: ./packed-demo)."),
    ] = None,
    pack_size: Annotated[
        int | None, typer.Option(help="Pack capacity in runtime tokens (default for the demo: 4096).")
    ] = None,
    max_seq_length: Annotated[
        int | None, typer.Option(help="Per-sample cap in runtime tokens (default: the pack size).")
    ] = None,
    tokenizer: options.TokenizerOption = None,
    format: options.FormatOption = Format.auto,
    loss_on: options.LossOnOption = LossOn.assistant,
    input_key: options.InputKey = "input",
    output_key: options.OutputKey = "output",
    messages_key: options.MessagesKey = "messages",
    tools_key: options.ToolsKey = "tools",
    prompt_template: options.PromptTemplate = None,
    algorithm: options.AlgorithmOption = Algorithm.bfd,
    balance_costs: Annotated[
        str | None,
        typer.Option(
            help="Spread pack compute evenly under a cost model (llama-8b, llama-1b, or a JSON file from "
            "tightpack calibrate): moves sequences between packs, at most 0.1% more packs."
        ),
    ] = None,
    pad_seq_to_mult: options.PadSeqToMult = None,
    tp: options.Tp = 1,
    cp: options.Cp = 1,
    sp: options.Sp = False,
    long_samples: options.LongSamplesOption = LongSamples.truncate,
    truncate_field: options.TruncateField = None,
    truncation_method: options.TruncationMethodOption = TruncationMethod.right,
    chat_truncation: options.ChatTruncationOption = OLDEST_TURNS,
    template_var: options.TemplateVars = None,
    pad_to_max_length: Annotated[
        bool, typer.Option("--pad-to-max-length", help="Record: collate every pack to the full pack size.")
    ] = False,
    pad_cu_seqlens: Annotated[
        bool, typer.Option("--pad-cu-seqlens", help="Record: static boundary shapes (CUDA graphs).")
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Tokenization processes (default: the CPU count); with --engine ray, tokenizer actors "
            "(default: one per CPU of the cluster)."
        ),
    ] = None,
    engine: Annotated[
        Engine,
        typer.Option(help="Where tokenization runs: local processes, or a Ray cluster (tightpack[ray])."),
    ] = Engine.local,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="With --engine ray: 'auto' or host:port joins a running cluster; default: a local one."
        ),
    ] = None,
    preference_layout: Annotated[
        PreferenceLayout,
        typer.Option(
            help="With --format preference|kto|groups: pairs (each branch its own sequence, prompt "
            "included) or shared-prefix (the prompt once, its branches after it; needs a mask beyond "
            "block-diagonal)."
        ),
    ] = PreferenceLayout.pairs,
    weights: mixing.Weights = None,
    mix_by: mixing.MixByOption = mixing.MixBy.tokens,
    max_repetitions: mixing.MaxRepetitions = 1.0,
    mix_tokens: mixing.MixTokens = None,
    mix_packs: mixing.MixPacks = None,
    mix_window: mixing.MixWindow = 64,
    mix_tolerance: mixing.MixTolerance = None,
    seed: options.Seed = 0,
    reuse: options.Reuse = True,
    skip_bad_lines: options.SkipBadLines = False,
    output_format: Annotated[
        OutputFormat, typer.Option(help="parquet, or the legacy npy format.")
    ] = OutputFormat.parquet,
    split: options.Split = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing output folder.")
    ] = False,
    demo: Annotated[
        bool,
        typer.Option("--demo", help="Pack the embedded demo corpus (needed with --output and no input)."),
    ] = False,
    vision_processor: options.VisionProcessor = None,
    vision: options.VisionFamily = None,
    media_root: options.MediaRoot = None,
) -> None:
    """Tokenize samples and pack them into Megatron-Bridge-readable packed Parquet."""
    if inputs and demo:
        raise TightpackError("--demo packs the embedded corpus: give either inputs or --demo")
    if not inputs and output is not None and not demo:
        raise TightpackError(
            "no input given (a shell pattern that matched nothing passes no argument; quote it to have "
            "tightpack name it); to pack the demo corpus into --output, add --demo"
        )
    if inputs:
        if output is None:
            raise TightpackError("--output is required when inputs are given")
        if pack_size is None:
            raise TightpackError(
                "--pack-size is required when inputs are given (the model's sequence length)"
            )
    output = output or DEMO_OUTPUT
    config = pipeline.PackConfig(
        packed_sequence_size=DEMO_PACK_SIZE if pack_size is None else pack_size,
        max_seq_length=max_seq_length,
        pad_seq_to_mult=pad_seq_to_mult,
        tp=tp,
        cp=cp,
        sp=sp,
        algorithm=algorithm.value,
        seed=seed,
        balance_costs=balance_costs,
        long_samples=long_samples.value,
        pad_to_max_length=pad_to_max_length,
        pad_cu_seqlens=pad_cu_seqlens,
        workers=workers if workers is not None else None if engine == Engine.ray else _default_workers(),
        engine=engine.value,
        ray_address=ray_address,
        reuse_store=reuse,
        skip_bad_lines=skip_bad_lines,
        output_format=output_format.value,
        preference_layout=preference_layout.value,
        mixture=mixing.mixture_config(
            weights, mix_by, max_repetitions, mix_tokens, mix_packs, mix_window, mix_tolerance
        ),
        format=options.format_config(
            format=format,
            input_key=input_key,
            output_key=output_key,
            prompt_template=prompt_template,
            messages_key=messages_key,
            tools_key=tools_key,
            loss_on=loss_on,
            truncate_field=truncate_field,
            truncation_method=truncation_method,
            chat_truncation=chat_truncation,
            template_vars=template_var,
            vision=options.vision_spec(vision_processor, vision, media_root, inputs),
        ),
    )
    columns = (TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    config.validate()
    # Progress bars on a terminal only: in logs and pipes, stderr carries errors and nothing else.
    try:
        with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as display:
            result = pipeline.pack_dataset(
                inputs or None,
                output,
                config,
                tokenizer=tokenizer,
                overwrite=overwrite,
                progress=_RichProgress(display),
                split=split,
            )
    except KeyboardInterrupt:  # click would turn it into a silent exit 130
        raise Interrupted(output) from None
    _print_summary(result, config)
    if result.mixture is not None:
        stdout.print("\n".join(mixing.mixture_lines(result.mixture)), markup=False, highlight=False)
    if result.cost_balance:
        before, after = result.cost_balance["before"], result.cost_balance["after"]
        stdout.print(
            f"pack cost under {result.cost_balance['model']}: coefficient of variation {before['cv']:.4f} -> "
            f"{after['cv']:.4f}, max / mean {before['max_over_mean']:.3f} -> {after['max_over_mean']:.3f}, "
            f"packs {before['packs']:,} -> {after['packs']:,}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    stdout.print(_next_steps(result, config, split), markup=False, highlight=False, soft_wrap=True)
    for warning in result.warnings:
        stderr.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)


class Interrupted(Exception):
    """Ctrl-C during ``pack``: carries the output folder for the message."""


_TRUNCATION_LABELS = {
    "truncated_prompt_trimmed": "prompt trimmed",
    "truncated_turns_dropped": "turns dropped",
    "truncated_answer_cut": "answer cut",
    "truncated_end_cut": "end cut",
    "truncated_turns_kept": "turns kept (the template merges turns)",
}


def _next_steps(result, config, split: str | None = None) -> str:
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


def _print_summary(result, config) -> None:
    table = Table(title=f"tightpack pack -> {result.output}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = _sample_rows(result) if result.unit_kind is None else _unit_rows(result, config.preference_layout)
    for name, value in rows:
        table.add_row(name, value)
    stdout.print(table)
    print_bad_rows([(bad.location, bad.reason) for bad in result.bad_rows], " (listed in the manifest)")


def _sample_rows(result) -> list[tuple[str, str]]:
    """The summary of a run of SFT samples."""
    counts = result.counts
    return [
        ("samples in", f"{counts['samples_in']:,}"),
        ("packed", f"{counts['packed']:,}"),
        ("  of which truncated", f"{counts['truncated']:,}"),
        *(
            (f"    {label}", f"{counts[key]:,}")
            for key, label in _TRUNCATION_LABELS.items()
            if counts.get(key)
        ),
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
