"""``tightpack plan``: compare pack sizes at equal token slots per step, and recommend one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tightpack.cli import options
from tightpack.cli.app import (
    OLDEST_TURNS,
    Algorithm,
    Format,
    LongSamples,
    LossOn,
    TruncationMethod,
    app,
    print_bad_rows,
    stderr,
    stdout,
)
from tightpack.errors import TightpackError


@app.command()
def plan(
    inputs: options.Inputs = None,
    pack_sizes: Annotated[
        str, typer.Option(help="Candidate pack sizes, comma-separated.")
    ] = "2048,4096,8192,16384",
    token_slots: Annotated[
        int,
        typer.Option(help="Tokens per optimizer step, all ranks (GBS x pack size, equal for every size)."),
    ] = 65536,
    dp: Annotated[int, typer.Option("--dp", help="Data-parallel size, for the straggler overhead.")] = 1,
    cost_model: Annotated[
        str,
        typer.Option(
            help="Cost model: a preset (llama-8b, llama-1b) or a JSON file from tightpack calibrate."
        ),
    ] = "llama-8b",
    max_supervised_loss: Annotated[
        float,
        typer.Option(help="Largest share of supervised tokens a recommended size may lose to truncation."),
    ] = 0.01,
    tokenizer: options.TokenizerOption = None,
    format: options.FormatOption = Format.auto,
    loss_on: options.LossOnOption = LossOn.assistant,
    input_key: options.InputKey = "input",
    output_key: options.OutputKey = "output",
    messages_key: options.MessagesKey = "messages",
    tools_key: options.ToolsKey = "tools",
    prompt_template: options.PromptTemplate = None,
    algorithm: options.AlgorithmOption = Algorithm.bfd,
    pad_seq_to_mult: options.PadSeqToMult = None,
    tp: options.Tp = 1,
    cp: options.Cp = 1,
    sp: options.Sp = False,
    long_samples: options.LongSamplesOption = LongSamples.truncate,
    truncate_field: options.TruncateField = None,
    truncation_method: options.TruncationMethodOption = TruncationMethod.right,
    chat_truncation: options.ChatTruncationOption = OLDEST_TURNS,
    template_var: options.TemplateVars = None,
    workers: Annotated[int, typer.Option(help="Tokenization processes.")] = 1,
    seed: options.Seed = 0,
    reuse: options.Reuse = True,
    skip_bad_lines: options.SkipBadLines = False,
    split: options.Split = None,
    vision_processor: options.VisionProcessor = None,
    vision: options.VisionFamily = None,
    media_root: options.MediaRoot = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write the measures against pack size as a PNG (tightpack[plots]).")
    ] = None,
    html: Annotated[
        Path | None, typer.Option(help="Write a self-contained HTML report (table and plots).")
    ] = None,
) -> None:
    """Plan each pack size on one tokenization; compare fill, lost tokens, cost and balance; recommend.

    Exits 1 when no pack size can run at this DP and token slots, or ``pack`` would refuse every size
    (as ``validate`` and ``verify`` exit 1 on what they find), 2 on a user error.
    """
    from tightpack.offline.config import PackConfig
    from tightpack.reports.pack_sizes import compare_pack_sizes

    sizes = _sizes(pack_sizes)
    if plot is not None or html is not None:
        from tightpack.reports import plots

        plots.require_matplotlib()  # before the work, not after it
    config = PackConfig(
        packed_sequence_size=max(sizes),
        pad_seq_to_mult=pad_seq_to_mult,
        tp=tp,
        cp=cp,
        sp=sp,
        algorithm=algorithm.value,
        seed=seed,
        long_samples=long_samples.value,
        workers=workers,
        reuse_store=reuse,
        skip_bad_lines=skip_bad_lines,
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
    comparison = compare_pack_sizes(
        inputs or None,
        sizes,
        token_slots=token_slots,
        config=config,
        tokenizer=tokenizer,
        cost_model=cost_model,
        data_parallel_size=dp,
        max_supervised_loss=max_supervised_loss,
        split=split,
    )
    if plot is not None or html is not None:
        figure = plots.plan_figure(comparison)
        if plot is not None:
            plots.save_png(figure, plot)
        if html is not None:
            notes = [f"recommended: {comparison.reason}"]
            plots.write_html_report(html, "tightpack plan", comparison.table(), [figure], notes=notes)
    if as_json:
        print(json.dumps(comparison.to_dict(), indent=2))
        _exit_when_nothing_runs(comparison)
        return
    header, *measures = comparison.table()
    table = Table(title=_title(comparison))
    for index, name in enumerate(header):
        table.add_column(
            name, style="bold" if index == 0 else None, justify="left" if index == 0 else "right"
        )
    for cells in measures:
        table.add_row(*cells)
    stdout.print(table)
    stdout.print(f"recommended: {comparison.reason}", markup=False, highlight=False, soft_wrap=True)
    for row in comparison.rows:
        if row.note:
            stderr.print(f"note: {row.pack_size}: {row.note}", markup=False, highlight=False, soft_wrap=True)
    print_bad_rows([(bad["location"], bad["reason"]) for bad in comparison.bad_rows])
    _exit_when_nothing_runs(comparison)


def _exit_when_nothing_runs(comparison) -> None:
    if comparison.recommended is None:
        raise typer.Exit(1)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TightpackError(f"--pack-sizes must be integers separated by commas, got {text!r}") from None
    if not sizes:
        raise TightpackError("--pack-sizes is empty; give the candidates, e.g. --pack-sizes 2048,4096,8192")
    return sizes


def _title(comparison) -> str:
    reused = " (token store reused)" if comparison.reused_store else ""
    skipped = len(comparison.bad_rows)
    samples = (
        f"{comparison.samples_in:,} rows read, {skipped:,} bad rows skipped, "
        f"{comparison.samples_tokenized:,} samples planned"
        if skipped
        else f"{comparison.samples_in:,} samples"
    )
    return (
        f"{samples}, {comparison.token_slots:,} token slots per step, "
        f"DP {comparison.data_parallel_size}, multiple {comparison.multiple}, cost model "
        f"{comparison.cost_model['name']}; tokenize {comparison.seconds['tokenize']:.2f} s{reused}, "
        f"plan {comparison.seconds['plan']:.2f} s"
    )
