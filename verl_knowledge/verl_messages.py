"""Hydra's compose errors, said the way a verl user can act on them.

Hydra's own text for a misspelt key ends with "To append to your config use +key=…": advice
that would make verl run with the typo silently ignored. Here a key verl does not have gets
the closest key verl does have ("did you mean `ppo_mini_batch_size`?"), ``+key`` on a key verl
already has says to drop the ``+`` (Hydra refuses it, so verl's own launcher would too), and an
unknown config group lists the group's options.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

_NOT_IN_STRUCT = re.compile(r"Could not override '([^']+)'")
_ALREADY_THERE = re.compile(r"Could not append to config\. An item is already at '([^']+)'")
_NO_GROUP_OPTION = re.compile(r"Could not find '([^'/]+)/([^']+)'")


def one_line(e: BaseException) -> str:
    """An exception in one line: Hydra wraps the real error; its first line names the target,
    the cause says what broke."""
    text = str(e).strip() or type(e).__name__
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text} ({str(cause).strip()})"
    return " ".join(text.split())


def _node(defaults: Any, path: list[str]) -> Any:
    from omegaconf import DictConfig

    node = defaults
    for part in path:
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
        node = node if isinstance(node, DictConfig) else None
    return node


#: keys of older verl releases that verl now keeps under another name (or folded into another):
#: a name-alike would be a wrong guess for these
_RENAMED = {
    "actor_rollout_ref.rollout.val_temperature": "actor_rollout_ref.rollout.val_kwargs.temperature",
    "actor_rollout_ref.rollout.n_val": "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.val_top_p": "actor_rollout_ref.rollout.val_kwargs.top_p",
    "actor_rollout_ref.rollout.val_top_k": "actor_rollout_ref.rollout.val_kwargs.top_k",
    "trainer.remove_previous_ckpt": "trainer.max_actor_ckpt_to_keep",
    "trainer.remove_previous_ckpt_in_save": "trainer.max_actor_ckpt_to_keep",
}
#: a key's last part → why verl no longer has it, for keys older releases dropped
_DROPPED = {
    "grad_offload": "verl offloads the gradients with the parameters (fsdp_config.param_offload). Drop it",
}


def missing_key(key: str, defaults: Any) -> str:
    """``key`` (no ``+``) is not in verl's config: where it breaks off, and the closest name."""
    if key in _RENAMED:
        return (f"{key}: verl has no such key (an older release's name); did you mean `{_RENAMED[key]}`? Use that "
                "name (verl would refuse the run)")
    last = key.rsplit(".", 1)[-1]
    if last in _DROPPED:
        return f"{key}: verl has no such key: {_DROPPED[last]} (verl would refuse the run)"
    parts = key.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        parent = _node(defaults, parts[:depth])
        if parent is None:
            continue
        wrong = parts[depth]
        names = [str(k) for k in parent.keys()]
        if depth > 0 and wrong in {str(k) for k in defaults.keys()} and wrong not in names:
            return (f"{key}: verl has no key {wrong!r} under {'.'.join(parts[:depth])}: {wrong} is chosen at the top "
                    f"level ({wrong}=…). Move it there")
        close = difflib.get_close_matches(wrong, names, n=1, cutoff=0.7)
        where = ".".join(parts[:depth]) or "the top level"
        if close:
            return (f"{key}: verl has no key {wrong!r} under {where}; did you mean `{close[0]}`? Fix the "
                    "spelling (verl would refuse the run)")
        shown = ", ".join(sorted(names)[:8]) + (", …" if len(names) > 8 else "")
        return (f"{key}: verl has no key {wrong!r} under {where} (it has {shown}). Check the name against "
                "verl's config: `python -m verl.trainer.main_ppo --cfg job`")
    return f"{key}: verl has no such key. Check the name against verl's config: `python -m verl.trainer.main_ppo --cfg job`"


def missing_config_packages(config: Mapping[str, Any]) -> list[str]:
    """``hydra.searchpath`` packages (``pkg://verl_mlite.config``) that are not installed here."""
    import importlib.util

    paths = config.get("hydra.searchpath") or config.get("+hydra.searchpath") or []
    missing = []
    for path in paths if isinstance(paths, list) else [paths]:
        if isinstance(path, str) and path.startswith("pkg://"):
            package = path[len("pkg://"):].split(".")[0]
            if importlib.util.find_spec(package) is None:
                missing.append(package)
    return missing


def refused_key(error: BaseException) -> str | None:
    """The config key of the override Hydra refused (a key verl lacks, ``+`` on one it has),
    as the config holds it; None for any other refusal."""
    text = one_line(error)
    found = _ALREADY_THERE.search(text)
    if found:
        return "+" + found.group(1)
    found = _NOT_IN_STRUCT.search(text)
    return found.group(1) if found and "is not in struct" in text else None


def compose_problem(error: BaseException, config: Mapping[str, Any], defaults: Any, *, config_dir: str) -> str:
    """One line for a config Hydra refused to compose."""
    text = one_line(error)
    plugins = missing_config_packages(config)
    if plugins and _NOT_IN_STRUCT.search(text):
        key = _NOT_IN_STRUCT.search(text).group(1)  # type: ignore[union-attr]
        return (f"{key}: comes from the config package {', '.join(plugins)} (hydra.searchpath), which is not installed "
                "here, and verl's own config has no such key. Validate where that package is installed")
    found = _ALREADY_THERE.search(text)
    if found:
        key = found.group(1)
        return (f"+{key}: the + adds a key, but verl already has {key} (Hydra refuses this, so verl's own "
                f"launcher would too). Write {key} without the +")
    found = _NOT_IN_STRUCT.search(text)
    if found and "is not in struct" in text:
        return missing_key(found.group(1).lstrip("+"), defaults)
    found = _NO_GROUP_OPTION.search(text)
    if found:
        import os

        group, option = found.groups()
        folder = os.path.join(config_dir, group)
        options = sorted(name[:-5] for name in os.listdir(folder) if name.endswith(".yaml")) if os.path.isdir(folder) else []
        return f"{group}={option}: verl's {group} must be one of {', '.join(options)}"
    return f"verl compose: {text}"
