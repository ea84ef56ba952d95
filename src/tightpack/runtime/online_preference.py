"""Online packing of preference pairs, KTO samples and groups: each unit is one candidate, never split.

`OnlinePreferencePacker` is the `tightpack.runtime.online.OnlinePacker` (the buffer, both selection
strategies, the ``max_wait`` bound, the cost cap, the counts and the exact resume, all unchanged)
over a stream of preference *units* (`tightpack.core.preference_units.PreferenceUnits`): a prompt and
its branches. A unit is one candidate whose length is its size in the chosen layout
(`tightpack.core.preference_units.unit_sizes`, alignment included) and whose cost is its cost in that
layout (`tightpack.core.preference_costs.unit_costs`); every pack is one preference row
(`tightpack.runtime.preference_batch.build_preference_row`) holding its units whole.

A sample of the stream is ``{"key": key, "units": PreferenceUnits}`` with exactly one unit.
`PreferenceRowSource` makes them from raw rows (TRL's ``prompt`` / ``chosen`` / ``rejected``, KTO or
group rows), tokenized one by one as the packer reads them (`tightpack.prepare.preference_rows`).

A unit above ``pack_size`` follows ``long_samples``: ``truncate`` fits it as the collator does
(`tightpack.core.preference_units.fit_units`: the shared prompt trimmed first, then the branch ends;
a unit that cannot fit, or whose cut leaves a branch without a supervised token, is left out whole,
logged with its reason), ``drop`` leaves it out, ``error`` stops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tightpack.core.preference_costs import unit_costs
from tightpack.core.preference_units import LAYOUTS, Layout, PreferenceUnits, fit_units, unit_sizes
from tightpack.errors import TightpackError, check_choice
from tightpack.logs import logger
from tightpack.prepare.preference_rows import PreferenceEncoder, PreferenceKind
from tightpack.prepare.tokenizer import TokenizerSpec, load_tokenizer
from tightpack.runtime import thd
from tightpack.runtime.online import OnlinePacker
from tightpack.runtime.online_config import OnlinePackConfig
from tightpack.runtime.online_mixture import WeightedSources
from tightpack.runtime.online_select import Candidate
from tightpack.runtime.preference_batch import build_preference_row

__all__ = ["OnlinePreferencePacker", "PreferenceRowSource"]

PREFERENCE_COUNTS = ("bad_rows", "prompt_trimmed", "branches_cut", "no_supervised")
"""The counts an `OnlinePreferencePacker` adds to the online packer's."""


class PreferenceRowSource:
    """A restartable stream of preference units from raw rows, for `OnlinePreferencePacker`.

    ``source(start, stride)`` yields the rows at positions ``start, start + stride, ...`` as samples
    ``{"key": position, "units": one unit}``, each tokenized when it is read (a DataLoader worker
    tokenizes only its own rows); ``restore(position)`` prepares one again, for a resume.

    Args:
        rows: the rows, any sequence with ``len`` and indexing (a list, a ``datasets.Dataset``).
        tokenizer: a `TokenizerSpec`, a tokenizer path, or None for the built-in GPT-2.
        kind: ``preference`` (prompt / chosen / rejected), ``kto`` or ``groups``.
        skip_bad_rows: a row that cannot become a unit becomes ``{"key": position, "bad_row":
            reason}``, which the packer counts (``bad_rows``) and logs, instead of raising. The row
            keeps its position, so a resumed packer reads on from the right row.
        template_vars: extra variables of the chat template.

    >>> source = PreferenceRowSource([{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}] * 3)
    >>> [(sample["key"], len(sample["units"])) for sample in source(1, 1)]
    [(1, 1), (2, 1)]
    """

    def __init__(
        self,
        rows: Sequence[Any],
        tokenizer: TokenizerSpec | str | None = None,
        *,
        kind: PreferenceKind = "preference",
        skip_bad_rows: bool = False,
        template_vars: dict[str, Any] | None = None,
    ) -> None:
        spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else load_tokenizer(tokenizer)
        self.rows = rows
        self.encoder = PreferenceEncoder(spec, kind, tuple(sorted((template_vars or {}).items())))
        self.skip_bad_rows = skip_bad_rows

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, position: int) -> dict[str, Any]:
        """The sample of the row at ``position``.

        Raises:
            TightpackError: the row cannot become a unit (without ``skip_bad_rows``).
        """
        encoded = self.encoder.encode_rows([self.rows[position]], first_sample=position)
        if encoded.bad_rows:
            reason = encoded.bad_rows[0].reason
            if not self.skip_bad_rows:
                raise TightpackError(f"row {position}: {reason} (fix the row, or pass skip_bad_rows=True)")
            return {"key": position, "bad_row": reason}
        return {"key": position, "units": encoded.units}

    def __call__(self, start: int, stride: int) -> Iterator[dict[str, Any]]:
        for position in range(start, len(self.rows), stride):
            yield self.sample(position)

    def restore(self, key: int) -> dict[str, Any]:
        """The sample with key ``key`` (its position), prepared again."""
        return self.sample(int(key))


class OnlinePreferencePacker(OnlinePacker):
    """Pack a stream of preference units online, one preference row per step, every unit whole.

    Args:
        source: ``source(start, stride)`` yields the samples at positions ``start, start + stride, ...``
            of the stream: ``{"key": key, "units": PreferenceUnits}`` with one unit each (or
            ``{"key": key, "bad_row": reason}``, counted and left out); `PreferenceRowSource` makes
            them from raw rows.
        config: the settings (`OnlinePackConfig`); ``pad_to_multiple_of`` aligns every THD sequence
            (each branch for ``pairs``, each unit for ``shared-prefix``); ``cost_model`` prices a unit
            in its layout (`tightpack.core.preference_costs.unit_costs`).
        layout: ``pairs`` or ``shared-prefix`` (`tightpack.runtime.preference_batch`).
        restore: ``restore(key)`` prepares the sample with that key again (for `load_state_dict`).
        rank: this data-parallel rank; each rank packs its own shard.
        world_size: the number of data-parallel ranks.

    Each pack is a preference row ``[1, T]`` (the keys of `build_preference_row`) with ``keys``, its
    units' keys in order. ``counts`` are the online packer's, ``samples`` counting units and
    ``tokens`` the real tokens of the rows (a ``pairs`` unit's prompt once per branch), and:
    ``truncated`` (units fitted to ``pack_size``), of which ``prompt_trimmed`` and ``branches_cut``;
    ``dropped`` (units left out), of which ``no_supervised`` (a cut would have left a branch without a
    supervised token); ``bad_rows``. A resumed packer refuses a state saved with another layout.

    >>> units = [PreferenceUnits.from_lists([[1, 2, 3]], [[4] * n, [5]], [2]) for n in (5, 2, 4, 1)]
    >>> samples = [{"key": i, "units": u} for i, u in enumerate(units)]
    >>> config = OnlinePackConfig(pack_size=16, packing_buffer_size=4)
    >>> packer = OnlinePreferencePacker(lambda start, stride: iter(samples[start::stride]), config,
    ...                                 layout="shared-prefix")
    >>> [(pack["keys"], pack["input_ids"].shape[1]) for pack in packer]  # units of 10, 7, 9 and 6 tokens
    [([0, 3], 16), ([1, 2], 16)]
    """

    def __init__(
        self,
        source: Callable[[int, int], Iterator[dict[str, Any]]],
        config: OnlinePackConfig,
        *,
        layout: Layout = "pairs",
        restore: Callable[[Any], dict[str, Any]] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        check_choice("layout", layout, LAYOUTS)
        if isinstance(source, WeightedSources):
            raise TightpackError(
                "OnlinePreferencePacker reads one source of preference units: WeightedSources mixes "
                "SFT samples (OnlinePacker); mix preference rows before they reach the packer"
            )
        self.layout = layout  # before the base class's _reset, which counts per layout
        super().__init__(source, config, restore=restore, rank=rank, world_size=world_size)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Any],
        config: OnlinePackConfig,
        *,
        tokenizer: TokenizerSpec | str | None = None,
        kind: PreferenceKind = "preference",
        layout: Layout = "pairs",
        skip_bad_rows: bool = False,
        template_vars: dict[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> OnlinePreferencePacker:
        """The packer of raw rows (a `PreferenceRowSource` over ``rows``, keyed by position, which
        also restores them)."""
        source = PreferenceRowSource(
            rows, tokenizer, kind=kind, skip_bad_rows=skip_bad_rows, template_vars=template_vars
        )
        return cls(source, config, layout=layout, restore=source.restore, rank=rank, world_size=world_size)

    def _reset(self) -> None:
        super()._reset()
        self.counts |= dict.fromkeys(PREFERENCE_COUNTS, 0)

    def _settings(self) -> dict[str, Any]:
        return super()._settings() | {"preference_layout": self.layout}

    # -- reading ------------------------------------------------------------------------------------

    def _units(self, sample: dict[str, Any]) -> PreferenceUnits:
        units = sample.get("units")
        if not isinstance(units, PreferenceUnits) or len(units) != 1:
            got = f"{len(units)} units" if isinstance(units, PreferenceUnits) else type(units).__name__
            raise TightpackError(
                f"sample {sample.get('key')!r}: 'units' must be a PreferenceUnits of one unit (a prompt and "
                f"its branches), got {got}; make the samples with PreferenceRowSource, or give each unit "
                "of PreferenceEncoder(...).encode_rows(rows).units.select([i]) its own sample"
            )
        return units

    def _sample_tokens(self, sample: dict[str, Any]) -> int:
        return int(unit_sizes(self._units(sample), self.layout)[0])

    def _admit(self, sample: dict[str, Any], arrival: int, *, count: bool = True) -> Candidate | None:
        """The candidate of a unit, after the long-sample policy (counted unless ``count`` is False)."""
        key = sample.get("key")
        if "bad_row" in sample:
            self.counts["bad_rows"] += count
            if count:
                logger().warning("left out a bad row: %r: %s", key, sample["bad_row"])
            return None
        units = self._units(sample)
        size, multiple = self.config.pack_size, self.config.pad_to_multiple_of
        tokens = int(unit_sizes(units, self.layout)[0])
        aligned = int(unit_sizes(units, self.layout, multiple)[0])
        if aligned > size:
            units = self._fit(key, units, aligned, count)
            if units is None:
                return None
            sample = {**sample, "units": units}
            aligned = int(unit_sizes(units, self.layout, multiple)[0])
        cost = 0.0
        if self.cost_model is not None:
            cost = float(unit_costs(units, self.layout, self.cost_model, pad_to_multiple_of=multiple)[0])
        nbytes = sum(value.nbytes for value in vars(units).values() if isinstance(value, np.ndarray))
        return Candidate(key, sample, aligned, arrival, tokens, nbytes, cost)

    def _fit(self, key: Any, units: PreferenceUnits, aligned: int, count: bool) -> PreferenceUnits | None:
        """A unit above ``pack_size`` under ``long_samples``: fitted, or None when left out (counted)."""
        size, policy = self.config.pack_size, self.config.long_samples
        if policy == "error":
            raise TightpackError(
                f"unit {key!r} takes {aligned} tokens in the {self.layout} layout, above the pack size "
                f"{size}; raise pack_size or choose long_samples='truncate' or 'drop'"
            )
        if policy == "drop":
            self.counts["dropped"] += count
            return None
        fit = fit_units(units, size, self.layout, pad_to_multiple_of=self.config.pad_to_multiple_of)
        if fit.dropped:
            self.counts["dropped"] += count
            self.counts["no_supervised"] += count * len(fit.no_supervised)
            if count:
                logger().warning("left out unit %r over pack_size=%d: %s", key, size, fit.dropped[0])
            return None
        self.counts["truncated"] += count
        self.counts["prompt_trimmed"] += count * fit.prompt_trimmed
        self.counts["branches_cut"] += count * fit.branches_cut
        return fit.units

    # -- emission -----------------------------------------------------------------------------------

    def _pack(self, group: list[Candidate]) -> dict[str, Any]:
        config = self.config
        units = PreferenceUnits.concatenate([candidate.sample["units"] for candidate in group])
        batch = build_preference_row(
            units,
            self.layout,
            pad_to_multiple_of=config.pad_to_multiple_of,
            pad_token_id=config.pad_token_id,
            ignore_index=config.ignore_index,
        )
        if config.pad_to_max_length:
            batch = pad_preference_row(
                batch, config.pack_size, pad_token_id=config.pad_token_id, ignore_index=config.ignore_index
            )
        batch["keys"] = [c.key for c in group]
        self._record(group, tokens=int(unit_sizes(units, self.layout).sum()))
        return batch


def pad_preference_row(
    batch: dict[str, Any], width: int, *, pad_token_id: int = 0, ignore_index: int = -100
) -> dict[str, Any]:
    """The preference row ``batch`` widened to ``width`` tokens (static shapes): the last THD sequence's
    alignment tail grows, as `tightpack.runtime.in_batch.build_thd_from_rows` lets the last segment
    absorb the fill (pad tokens, no label, positions going on, inside the last branch), so every
    branch and unit stays whole.

    >>> units = PreferenceUnits.from_lists([[1, 2, 3]], [[7, 8], [9]], [2])
    >>> row = pad_preference_row(build_preference_row(units, "shared-prefix"), 9)
    >>> row["input_ids"].tolist(), row["position_ids"].tolist(), row["cu_seqlens_q_padded"].tolist()
    ([[1, 2, 3, 7, 8, 3, 9, 0, 0]], [[0, 1, 2, 3, 4, 2, 3, 4, 5]], [0, 9])
    """
    current = int(batch["input_ids"].shape[1])
    if width < current:
        raise TightpackError(f"a preference row of {current} tokens cannot be padded to {width}")
    extra = width - current
    if extra == 0:
        return batch
    out = dict(batch)

    def extend(key: str, value: Any) -> None:
        tail = torch.full((1, extra), value, dtype=batch[key].dtype)
        out[key] = torch.cat([batch[key], tail], dim=1)

    extend("input_ids", pad_token_id)
    extend("labels", ignore_index)
    extend("loss_mask", 0)
    last = batch["position_ids"][0, -1]
    out["position_ids"] = torch.cat([batch["position_ids"], last + 1 + torch.arange(extra)[None]], dim=1)
    if batch.get("branch_ids") is not None:
        extend("branch_ids", int(batch["branch_ids"][0, -1]))
    padding = batch.get("padding_mask")
    out["padding_mask"] = torch.cat(
        [padding if padding is not None else torch.zeros(1, current, dtype=torch.bool),
         torch.ones(1, extra, dtype=torch.bool)], dim=1,
    )  # fmt: skip
    physical = batch.get("cu_seqlens_q_padded", batch["cu_seqlens_q"]).clone()
    physical[-1] = width
    out["cu_seqlens_q_padded"] = out["cu_seqlens_kv_padded"] = physical
    longest = torch.tensor(int(physical.diff().max()), dtype=torch.int32)
    out["max_seqlen_q"] = out["max_seqlen_kv"] = longest
    out["tokens"] = out["input_ids"]
    out["total_tokens"] = width
    thd.check_thd_batch(out)
    return out
