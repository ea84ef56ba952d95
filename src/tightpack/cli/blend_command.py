"""``tightpack blend``: the weights of Megatron-Bridge's run-time blend of separately packed folders."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shlex
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tightpack.cli.app import app, stderr, stdout
from tightpack.core.blend_weights import BlendPlan, FolderStats, plan_blend, written_weights
from tightpack.core.mixture import MIX_BY
from tightpack.core.pack_manifest import PackedData, locate_packed
from tightpack.errors import TightpackError

MixBy = Enum("MixBy", {value: value for value in MIX_BY}, type=str)
TOKENS = MixBy("tokens")
BLEND_KEY = "dataset.offline_packing_specs.packed_train_data_blend"
_UNITS = {"tokens": "tokens", "supervised-tokens": "supervised tokens", "samples": "samples"}


@app.command()
def blend(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="FOLDER=SHARE for each packed folder (or Parquet file or glob, as "
            "packed_train_data_blend takes): its target share of the --mix-by measure (any positive "
            "numbers; they are normalised).",
            show_default=False,
        ),
    ],
    mix_by: Annotated[
        MixBy,
        typer.Option(help="What the shares count: tokens, supervised tokens (with a loss) or samples."),
    ] = TOKENS,
    samples: Annotated[
        int | None,
        typer.Option(
            help="Rows (packs) the blend holds: global batch size x training steps, written as "
            "max_train_samples (default: the folders' packs summed, Megatron-Bridge's size without it).",
            min=1,
        ),
    ] = None,
    as_yaml: Annotated[
        bool, typer.Option("--yaml", help="Print only the configuration to paste (YAML).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the weights and shares as JSON.")] = False,
) -> None:
    """Weights of Megatron-Bridge's blend of packed folders that give target shares of tokens.

    Megatron-Bridge's packed_train_data_blend counts packs (rows), not tokens: each folder gets the
    weight that makes its expected share of the --mix-by measure its target. Prints each folder's
    weight, the packs it supplies and the passes over it, the shares by every measure, and the
    configuration (YAML and an override). Exits 2 on a user error (a folder that is not packed data,
    a bad share).
    """
    names, shares = _parse_targets(targets)
    located = [locate_source(name) for name in names]
    _check_distinct(names, located)
    folders = []
    for name, where in zip(names, located, strict=True):
        folder, note = read_folder_stats(name, where)
        folders.append(folder)
        if note:
            stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    plan = plan_blend(shares, folders, by=mix_by.value, samples=samples, names=names)
    if as_json:
        print(json.dumps(plan.to_dict(), indent=2))
        return
    if as_yaml:
        print(blend_yaml(plan, samples=samples), end="")
        return
    _print_plan(plan, folders, samples)


def _parse_targets(targets: list[str]) -> tuple[list[str], list[float]]:
    """The folders and their shares of ``FOLDER=SHARE`` arguments; an error naming a bad one."""
    names, shares = [], []
    for target in targets:
        name, equals, text = target.rpartition("=")
        if not equals or not name:
            raise TightpackError(
                f"{target!r} is not FOLDER=SHARE: give a share to each folder, e.g. {target}=0.5"
            )
        try:
            share = float(text)
        except ValueError:
            share = math.nan
        if not (math.isfinite(share) and share > 0):
            hint = " (leave the folder out instead of giving it 0)" if math.isfinite(share) else ""
            raise TightpackError(f"the share of {name} must be a positive number, got {text!r}{hint}")
        names.append(name)
        shares.append(share)
    if len(names) < 2:
        raise TightpackError("a blend needs two or more folders: FOLDER=SHARE FOLDER=SHARE ...")
    return names, shares


def parse_shares(text: str | None, flag: str) -> list[float] | None:
    """Comma-separated positive shares (``0.5,0.5``); None for None; an error naming ``flag`` otherwise."""
    if text is None:
        return None
    try:
        shares = [float(part) for part in text.split(",")]
    except ValueError:
        shares = []
    if not shares or not all(math.isfinite(share) and share > 0 for share in shares):
        raise TightpackError(
            f"{flag} must be positive numbers separated by commas (e.g. 0.5,0.5), got {text!r}"
        )
    return shares


def locate_source(path: str) -> PackedData:
    """The packs of a blend source: a packed folder, a Parquet file or a glob of them, resolved as
    ``tightpack validate`` resolves ``packed_train_data_blend``'s sources (`locate_packed`).

    Raises:
        TightpackError: ``path`` does not exist or names no packed data.
    """
    try:
        return locate_packed(path)
    except TightpackError as error:
        if not glob.has_magic(path) and not Path(path).exists():
            raise TightpackError(f"{path}: no such packed folder or Parquet file") from None
        raise TightpackError(f"{path} is not packed data: {error}") from None


def _check_distinct(names: list[str], located: list[PackedData]) -> None:
    """Refuse a source given twice: the same files, however spelled (``d``, ``./d``, ``d/*.parquet``),
    or files two sources share."""
    seen: dict[str, str] = {}  # a resolved file: the first source that names it
    for name, where in zip(names, located, strict=True):
        files = {os.path.realpath(file) for file in where.files}
        earlier = {seen[file] for file in files if file in seen}
        if earlier:
            first = next(other for other in names if other in earlier)
            if first == name:
                raise TightpackError(f"{name} is given twice: give each folder one share")
            same = files == {file for file, source in seen.items() if source == first}
            how = "names the same packs as" if same else "shares packed files with"
            raise TightpackError(f"{name} {how} {first}: give each folder one share")
        seen.update(dict.fromkeys(files, name))


def read_folder_stats(path: str, located: PackedData | None = None) -> tuple[FolderStats, str | None]:
    """What the packed folder ``path`` holds: from its manifest, else from its rows (and a note saying so).

    Args:
        path: a packed folder, a Parquet file or a glob of them.
        located: its packs (`locate_source`), when found already.

    Raises:
        TightpackError: ``path`` does not exist or holds no packed data.
    """
    from tightpack.core.pack_manifest import read_manifest

    located = located or locate_source(path)
    if located.manifest is not None:
        return FolderStats.from_manifest(read_manifest(located.manifest), str(located.manifest)), None
    from tightpack.reports.summary import read_pack_arrays

    arrays = read_pack_arrays(path)
    stats = FolderStats(
        packs=len(arrays.runtime),
        samples=int(arrays.sequences.sum()),
        tokens=int(arrays.runtime.sum()),
        supervised_tokens=int(arrays.supervised.sum()),
    )
    return (
        stats,
        f"{path} has no tightpack manifest: its {stats.packs:,} rows were read (tokens with padding)",
    )


def blend_yaml(plan: BlendPlan, *, samples: int | None) -> str:
    """The ``dataset`` keys of Megatron-Bridge's configuration that set the blend, as YAML."""
    import yaml

    dataset: dict = {"enable_offline_packing": True}
    if samples is not None:
        dataset["max_train_samples"] = samples
    dataset["offline_packing_specs"] = {"packed_train_data_blend": [list(plan.names), _weights(plan)]}
    return yaml.safe_dump({"dataset": dataset}, default_flow_style=None, sort_keys=False)


def blend_override(plan: BlendPlan, *, samples: int | None) -> str:
    """The same as Megatron-Bridge's command-line overrides (``KEY=VALUE``, Hydra syntax), shell-quoted."""
    paths = ",".join(_hydra_string(name) for name in plan.names)
    weights = ",".join(repr(weight) for weight in _weights(plan))
    words = [f"{BLEND_KEY}=[[{paths}],[{weights}]]"]
    if samples is not None:
        words.append(f"dataset.max_train_samples={samples}")
    return " ".join(shlex.quote(word) for word in words)


def _weights(plan: BlendPlan) -> list[float]:
    return written_weights(plan.weights)


def _hydra_string(text: str) -> str:
    """A path as a Hydra override value: bare when plain, else quoted."""
    if re.fullmatch(r"[\w./\-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _percent(values) -> str:
    return " / ".join(f"{value:.1%}" for value in values)


def _print_plan(plan: BlendPlan, folders: list[FolderStats], samples: int | None) -> None:
    unit = _UNITS[plan.by]
    origin = (
        "max_train_samples" if samples is not None else "the folders' packs summed, without max_train_samples"
    )
    size = f"{plan.samples:,} rows ({origin})"
    table = Table(title=f"blend by {unit}: {size}")
    for index, name in enumerate(
        ["folder", "packs", f"{unit} per pack", "target", "weight", "packs drawn", "passes"]
    ):
        table.add_column(name, justify="left" if index == 0 else "right")
    weights = _weights(plan)
    for index, (name, folder) in enumerate(zip(plan.names, folders, strict=True)):
        table.add_row(
            name,
            f"{folder.packs:,}",
            f"{folder.per_pack(plan.by):,.1f}",
            f"{plan.targets[index]:.1%}",
            f"{weights[index]:g}",
            f"{plan.drawn[index]:,}",
            f"{plan.passes[index]:.2f}",
        )
    stdout.print(table)
    say = lambda text: stdout.print(text, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    given = ", ".join(f"{_UNITS[by]} {_percent(shares)}" for by, shares in plan.shares.items())
    say(f"shares these weights give: {given}")
    naive = plan.naive.get(plan.by)
    if naive is not None:
        say(f"the targets written as weights would give: {unit} {_percent(naive)}")
    for name, passes in zip(plan.names, plan.passes, strict=True):
        if passes > 1:
            say(f"note: {name} is read {passes:.2f} times over (each pass in a new order)")
        elif passes < 0.999:
            say(f"note: only {passes:.0%} of {name} is read (a seeded subset of its packs)")
    say("")
    say("Megatron-Bridge (GPTSFTDatasetConfig, offline_packing_specs.packed_train_data_blend):")
    say(blend_yaml(plan, samples=samples).rstrip("\n"))
    say(f"override: {blend_override(plan, samples=samples)}")
