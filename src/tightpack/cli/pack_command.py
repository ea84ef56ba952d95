"""``tightpack pack``: tokenize, truncate, plan and write packs, with a progress display and a summary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
    stderr,
    stdout,
)
from tightpack.cli.pack_summary import next_steps, print_summary
from tightpack.errors import TightpackError
from tightpack.offline import pipeline
from tightpack.offline.config import mixture_refusal


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
    algorithm: Annotated[
        Algorithm | None,
        typer.Option(help="Packing algorithm (default bfd); a mixture (--weights) packs in its own order."),
    ] = None,
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
    seed: options.PackSeed = 0,
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
    if algorithm is not None and weights is not None:  # even bfd: the mixture would not use it
        raise mixture_refusal("algorithm")
    output = output or DEMO_OUTPUT
    config = pipeline.PackConfig(
        packed_sequence_size=DEMO_PACK_SIZE if pack_size is None else pack_size,
        max_seq_length=max_seq_length,
        pad_seq_to_mult=pad_seq_to_mult,
        tp=tp,
        cp=cp,
        sp=sp,
        algorithm=(algorithm or Algorithm.bfd).value,
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
    print_summary(result, config)
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
    stdout.print(next_steps(result, config, split), markup=False, highlight=False, soft_wrap=True)
    for warning in result.warnings:
        stderr.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)


class Interrupted(Exception):
    """Ctrl-C during ``pack``: carries the output folder for the message."""
