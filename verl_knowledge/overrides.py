"""A verl config as a flat mapping of dotted keys, and its Hydra override list.

Configs are plain ``dict[str, value]`` keyed by verl's dotted config path
(``actor_rollout_ref.actor.ppo_mini_batch_size``). Keys that verl's config does not define
carry Hydra's ``+`` prefix. Overrides go to processes as argv items, never through a shell,
and keys/values are checked so that a value cannot smuggle in a second override.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

Config = dict[str, Any]

KEY_PATTERN = re.compile(r"^\+{0,2}[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Characters that Hydra's override grammar treats specially inside an unquoted value.
_HYDRA_SPECIAL = re.compile(r"[\s,=\[\]{}()'\"\\:$*?<>|&;`#@%!~]")
_MAX_STRING = 4096
# A string Hydra would read as a number (0001, 1e-6, 1_000): quoted to stay a string.
_NUMBER = re.compile(r"^[-+]?(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)([eE][-+]?\d+)?$")
_DICT_KEY_CHARS = re.compile(r"^[A-Za-z0-9_.*{}()\[\]\-/:=, ]+$")


class VerlConfigError(ValueError):
    """A verl config that breaks one of verl's rules; the message names the key, value and rule."""


class OverrideError(VerlConfigError):
    """A key or value that cannot be written as one safe Hydra override."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.match(key):
        raise OverrideError(
            f"override key must be a dotted config path like 'data.train_batch_size', "
            f"but got {key!r}."
        )
    return key


def format_value(value: Any) -> str:
    """Render a Python value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if abs(value) > 2**63 - 1:
            raise OverrideError(f"integer override must fit in 64 bits, but got {value}.")
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise OverrideError(f"override value must be finite, but got {value}.")
        return repr(value)
    if isinstance(value, str):
        if len(value) > _MAX_STRING or "\n" in value or "\x00" in value:
            raise OverrideError(f"string override must be one short line, but got {value[:40]!r}.")
        if "${" in value:
            # Hydra resolves an interpolation even inside quotes: ${oc.env:HOME} would read
            # the probe's environment (the simulator takes it literally: two meanings).
            raise OverrideError(f"string override must not contain '${{' (an OmegaConf interpolation, which verl "
                                f"would resolve), but got {value[:40]!r}. Write the value itself.")
        if value == "" or _HYDRA_SPECIAL.search(value) or value.lower() in ("null", "true", "false", "inf", "nan") \
                or _NUMBER.match(value):
            # Quoted: Hydra takes the content literally, so commas or '=' cannot split it.
            escaped = value.replace("\\", "\\\\").replace("'", "\\'")
            return f"'{escaped}'"
        return value
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a mapping: Hydra's {key:value,...} (merged into verl's node under +key)
        return "{" + ", ".join(f"{_dict_key(key)}: {format_value(v)}" for key, v in value.items()) + "}"
    raise OverrideError(f"override value must be a scalar, a list or a mapping, but got {type(value).__name__}.")


def _dict_key(key: Any) -> str:
    """A mapping's key in Hydra's grammar: a name as it is, Hydra's special characters escaped
    with a backslash (``model.visual.blocks.\\{*\\}``), as Hydra's parser reads them back."""
    if not isinstance(key, str) or not key or not _DICT_KEY_CHARS.match(key) or "\n" in key:
        raise OverrideError(f"a mapping's keys must be names like 'attention_backend', but got {key!r}.")
    return re.sub(r"([\\()\[\]{}:=, \t])", r"\\\1", key)


def to_overrides(config: Mapping[str, Any]) -> list[str]:
    """``{key: value}`` → ``["key=value", ...]`` in a stable (sorted) order."""
    return [f"{check_key(k)}={format_value(v)}" for k, v in sorted(config.items())]


def strip_plus(key: str) -> str:
    return key.lstrip("+")


def merge(*configs: Mapping[str, Any]) -> Config:
    """Later configs win; ``+key`` and ``key`` name the same setting."""
    merged: Config = {}
    for config in configs:
        for key, value in config.items():
            for existing in [k for k in merged if strip_plus(k) == strip_plus(key)]:
                del merged[existing]
            merged[key] = value
    return merged


def get(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    for k in (key, "+" + key, "++" + key):
        if k in config:
            return config[k]
    return default


def nest(config: Mapping[str, Any]) -> dict[str, Any]:
    """Flat dotted keys → nested dicts (for YAML export)."""
    tree: dict[str, Any] = {}
    for key, value in sorted(config.items()):
        parts = strip_plus(key).split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise OverrideError(f"key {key!r} conflicts with a value set at {part!r}.")
        node[parts[-1]] = list(value) if isinstance(value, tuple) else value
    return tree


def parse_override(item: str) -> tuple[str, Any]:
    """``"key=value"`` → (key, value) with YAML typing of the value (used by the simulator)."""
    import yaml

    if "=" not in item:
        raise OverrideError(f"override must look like key=value, but got {item!r}.")
    key, raw = item.split("=", 1)
    check_key(key)
    if len(raw) >= 2 and raw[0] == raw[-1] == "'":
        return key, raw[1:-1].replace("\\'", "'").replace("\\\\", "\\")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def parse_overrides(items: Iterable[str]) -> Config:
    return merge(*({k: v} for k, v in map(parse_override, items)))
