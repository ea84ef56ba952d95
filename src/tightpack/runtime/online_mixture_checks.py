"""What the samples of weighted sources must hold, checked as `tightpack.runtime.online_mixture` reads
them: the same optional keys in every source (`check_optional_keys`), and some of the measure the
weights count in a pass of each source (`no_measure_error`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tightpack.errors import TightpackError

OPTIONAL_KEYS = ("labels", "loss_mask")
"""The keys a pack needs in all of its samples or in none (`tightpack.runtime.in_batch.pack_samples`);
the visual keys may differ (a sample without them adds nothing)."""

FirstSample = tuple[str, Any, frozenset[str]]  # (source name, key, optional keys) of the first sample


def _listed(keys: frozenset[str]) -> str:
    present = [key for key in OPTIONAL_KEYS if key in keys]
    return " and ".join(present) if present else "neither labels nor loss_mask"


def check_optional_keys(first: FirstSample | None, name: str, sample: Mapping[str, Any]) -> FirstSample:
    """The mixture's first sample (this one of source ``name`` when ``first`` is None), once ``sample``
    is checked to carry the same `OPTIONAL_KEYS` (not None) as it.

    Raises:
        TightpackError: ``sample`` carries other optional keys than the first sample: the message
            names both sources and samples and the keys that differ.
    """
    keys = frozenset(key for key in OPTIONAL_KEYS if sample.get(key) is not None)
    if first is None:
        return (name, sample.get("key"), keys)
    first_name, first_key, first_keys = first
    if keys != first_keys:
        differ = " and ".join(key for key in OPTIONAL_KEYS if key in keys ^ first_keys)
        both = f"every sample of {name}" if name == first_name else f"the samples of {first_name} and {name}"
        raise TightpackError(
            f"sample {sample.get('key')!r} of {name} carries {_listed(keys)}, but sample {first_key!r} "
            f"of {first_name}, the first the mixture read, carries {_listed(first_keys)}: a pack needs "
            f"{differ} in all of its samples or in none, so every source must carry the same optional "
            f"keys; prepare {both} with the same ones"
        )
    return first


def no_measure_error(name: str, mix_by: str, samples: int, shard: int, shards: int) -> TightpackError:
    """Why source ``name``, whose whole pass of ``samples`` samples in shard ``shard`` of ``shards``
    held none of ``mix_by`` (after the long-sample policy), can hold no share of the mixture."""
    unit = "supervised tokens" if mix_by == "supervised-tokens" else mix_by
    where = "" if shards == 1 else f" in shard {shard} of {shards}"
    if mix_by == "supervised-tokens":
        why = (
            "no loss_mask above 0 nor label other than ignore_index, after long_samples: 'truncate' "
            "keeps the first pack_size tokens and can cut every answer away, 'drop' leaves samples out"
        )
        fix = (
            "leave it out of the mixture, or mix by tokens or samples, or check its loss_mask or labels "
            "and the truncation"
        )
    else:
        why = "long_samples='drop' left out every one: each is longer than pack_size"
        fix = "leave it out of the mixture, or raise pack_size, or choose long_samples='truncate'"
    text = (
        f"{name} has no {unit} to mix: a whole pass of its {samples} sample{'s' * (samples != 1)}{where} "
        f"held none ({why}), so no weight gives it a share and the mixture would read nothing but it "
        f"until it ran out; {fix}"
    )
    if shards > 1:
        text += (
            f"; each shard (a DataLoader worker of a data-parallel rank) reads its own positions "
            f"{shard}, {shard + shards}, ... of every source, and this shard's part holds none even if "
            "another's holds some: with few samples that do, use fewer workers or ranks"
        )
    return TightpackError(text, parameters=("weights",))
