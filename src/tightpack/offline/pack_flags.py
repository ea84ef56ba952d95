"""The ``tightpack pack`` flag of every setting a manifest records, to write a run's command again.

`PackConfig.settings` is what ``manifest.json`` records under ``settings`` (the sample format under
``settings.format``). `SETTING_FLAGS` gives each of those settings, by its dotted path, the flag that
sets it, or says why no flag is written: the topology settings (pack size, alignment, fixed width)
come from the training configuration a re-pack is for, not from the old manifest. `sample_flags`
renders the recorded values that differ from the defaults, so ``tightpack validate``'s re-pack
command keeps every sample setting of the packs it replaces and changes only their topology.

A new field of `PackConfig` or `FormatConfig` must get an entry here: the tests compare the table with
the fields, and every flag with the options of ``tightpack pack``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tightpack.core.cost_model import COST_MODELS
from tightpack.offline.config import PackConfig

TOPOLOGY = "topology"
"""A `SettingFlag.derived` reason: the re-pack takes it from the training configuration."""


@dataclass(frozen=True)
class SettingFlag:
    """How one recorded setting is written as ``tightpack pack`` flags.

    Attributes:
        flag: the option (``--loss-on``); None when the setting has no flag of its own.
        render: the words for a recorded value (default: by the value's type: a true bool is the bare
            flag, a list is joined with commas, a mapping is one ``flag KEY=VALUE`` per item, anything
            else ``flag value``, shell-quoted).
        derived: why no flag is written (`TOPOLOGY`, or what the value follows from); "" when one is.
    """

    flag: str | None
    render: Callable[[Any], list[str]] | None = None
    derived: str = ""

    def words(self, value: Any) -> list[str]:
        if self.derived or self.flag is None:
            return []
        if self.render is not None:
            return self.render(value)
        if isinstance(value, bool):
            return [self.flag] if value else []
        if isinstance(value, Mapping):
            return [word for key, item in value.items() for word in (self.flag, shlex.quote(f"{key}={item}"))]
        if isinstance(value, (list, tuple)):
            return [self.flag, shlex.quote(",".join(map(str, value)))]
        return [self.flag, shlex.quote(str(value))]


def _truncate_fields(value: Any) -> list[str]:
    return ["--truncate-field", "none" if not value else shlex.quote(",".join(value))]


def _balance_costs(value: Any) -> list[str]:
    """The preset whose coefficients the manifest records, else a placeholder for its JSON file."""
    named = [name for name, model in COST_MODELS.items() if model.to_dict() == value]
    return ["--balance-costs", named[0] if named else "COST_MODEL.json"]


def _prompt_template(value: Any) -> list[str]:
    r"""The recorded template as the CLI reads it back (`tightpack.cli.options.decode_escapes`): a
    backslash, a newline and a tab written as ``\\``, ``\n`` and ``\t``.

    >>> from tightpack.cli.options import decode_escapes
    >>> template = "Q: {input}\nA:\t\\n {output}"
    >>> flag, word = _prompt_template(template)
    >>> decode_escapes(shlex.split(word)[0]) == template
    True
    """
    escaped = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    return ["--prompt-template", shlex.quote(escaped)]


def _template_vars(value: Any) -> list[str]:
    """Recorded ``(name, value)`` pairs: one ``--template-var NAME=VALUE`` each, the value as JSON."""
    pairs = value.items() if isinstance(value, Mapping) else value
    return [w for name, item in pairs for w in ("--template-var", shlex.quote(f"{name}={json.dumps(item)}"))]


def _vision(value: Any) -> list[str]:
    """The manifest records the processor's sizes, not its folder: the folder is a placeholder."""
    sizes = value.get("sizes", {}) if isinstance(value, Mapping) else {}
    words = ["--vision-processor", "PROCESSOR_FOLDER"]
    if sizes.get("model"):
        words += ["--vision", shlex.quote(str(sizes["model"]))]
    if value.get("media_root"):
        words += ["--media-root", shlex.quote(str(value["media_root"]))]
    return words


def _mixture(value: Any) -> list[str]:
    """``--weights`` and the mixture options whose recorded values differ from the defaults."""
    words = ["--weights", shlex.quote(",".join(f"{weight:g}" for weight in value["weights"]))]
    for key, flag, default in (
        ("mix_by", "--mix-by", "tokens"),
        ("max_repetitions", "--max-repetitions", 1.0),
        ("total_tokens", "--mix-tokens", None),
        ("total_packs", "--mix-packs", None),
        ("window_packs", "--mix-window", 64),
        ("tolerance", "--mix-tolerance", None),
    ):
        if value.get(key, default) != default:
            words += [
                flag,
                shlex.quote(f"{value[key]:g}" if isinstance(value[key], float) else str(value[key])),
            ]
    return words


SETTING_FLAGS: dict[str, SettingFlag] = {
    "packed_sequence_size": SettingFlag("--pack-size", derived=TOPOLOGY),
    "max_seq_length": SettingFlag("--max-seq-length", derived="the re-pack's pack size (see repack)"),
    "pad_seq_to_mult": SettingFlag("--pad-seq-to-mult", derived=TOPOLOGY),
    "tp": SettingFlag("--tp", derived=TOPOLOGY),
    "cp": SettingFlag("--cp", derived=TOPOLOGY),
    "sp": SettingFlag("--sp", derived=TOPOLOGY),
    "pad_to_max_length": SettingFlag("--pad-to-max-length", derived=TOPOLOGY),
    "pad_cu_seqlens": SettingFlag("--pad-cu-seqlens", derived=TOPOLOGY),
    "row_group_size": SettingFlag(None, derived="Parquet layout only (no flag; the default per pack size)"),
    "algorithm": SettingFlag("--algorithm"),
    "seed": SettingFlag("--seed"),
    "balance_costs": SettingFlag("--balance-costs", render=_balance_costs),
    "long_samples": SettingFlag("--long-samples"),
    "skip_bad_lines": SettingFlag("--skip-bad-lines"),
    "output_format": SettingFlag("--output-format"),
    "format.format": SettingFlag("--format"),
    "format.input_key": SettingFlag("--input-key"),
    "format.output_key": SettingFlag("--output-key"),
    "format.prompt_template": SettingFlag("--prompt-template", render=_prompt_template),
    "format.messages_key": SettingFlag("--messages-key"),
    "format.tools_key": SettingFlag("--tools-key"),
    "format.loss_on": SettingFlag("--loss-on"),
    "format.truncate_fields": SettingFlag("--truncate-field", render=_truncate_fields),
    "format.truncation_method": SettingFlag("--truncation-method"),
    "format.chat_truncation": SettingFlag("--chat-truncation"),
    "format.vision": SettingFlag("--vision-processor", render=_vision),
    "format.template_vars": SettingFlag("--template-var", render=_template_vars),
    "preference_layout": SettingFlag("--preference-layout"),
    "mixture": SettingFlag("--weights", render=_mixture),
}
"""Every setting of `PackConfig.settings` by dotted path (``format.loss_on``), and its flag."""


def recorded_paths(settings: Mapping[str, Any]) -> list[str]:
    """The dotted paths of ``settings`` (a manifest's ``settings``), ``format`` expanded one level.

    >>> recorded_paths({"seed": 0, "format": {"loss_on": "all"}})
    ['seed', 'format.loss_on']
    """
    paths = []
    for key, value in settings.items():
        if key == "format" and isinstance(value, Mapping):
            paths += [f"format.{name}" for name in value]
        else:
            paths.append(key)
    return paths


def _lookup(settings: Mapping[str, Any], path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def sample_flags(settings: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The ``tightpack pack`` words that reproduce the non-topology settings of a manifest, and the
    recorded settings this table does not know (a manifest of a newer tightpack; the caller says so).

    Only values that differ from `PackConfig`'s defaults are written.

    >>> sample_flags({"long_samples": "drop", "seed": 0, "format": {"loss_on": "all"}})
    (['--long-samples', 'drop', '--loss-on', 'all'], [])
    """
    defaults = PackConfig(packed_sequence_size=1).settings()
    words: list[str] = []
    unknown: list[str] = []
    for path in recorded_paths(settings):
        entry = SETTING_FLAGS.get(path)
        if entry is None:
            unknown.append(path)
            continue
        value = _lookup(settings, path)
        if value is None or value == _lookup(defaults, path):
            continue
        words += entry.words(value)
    return words, unknown
