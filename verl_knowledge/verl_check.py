"""Compose a config with verl's own Hydra config and run verl's CPU-side checks on it.

verl is imported lazily: without it, :func:`validate_with_verl` logs one warning and accepts
everything (the rules in :func:`verl_sweep.verl_knowledge.rules.check_config` still apply). With it, each config
is composed from ``ppo_trainer`` (unknown keys fail here), checked by
``verl.utils.config.validate_config`` as ``main_ppo`` does, and the config dataclasses the
trainer builds later (rollout, algorithm, ref, model, KL controller, advantage estimator) are
instantiated so their ``__post_init__`` checks run too. Nothing is downloaded: a model path
that is not a local directory is not instantiated (verl's critic check reads the critic's
``config.json`` and tokenizer itself, so point ``critic.model.path`` at a local directory).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import threading
import warnings
from types import TracebackType
from typing import Any, Mapping

from verl_sweep.verl_knowledge.overrides import to_overrides
from verl_sweep.verl_knowledge.verl_messages import one_line

logger = logging.getLogger(__name__)

#: verl keys that moved between releases: name → [(first version, key), ...] newest last
_MOVED_KEYS: dict[str, list[tuple[tuple[int, ...], str]]] = {
    "grad_clip": [
        ((0,), "actor_rollout_ref.actor.grad_clip"),
        ((0, 8), "actor_rollout_ref.actor.optim.clip_grad"),  # grad_clip unread since 0.8
    ],
    "lr_scheduler": [
        ((0,), "actor_rollout_ref.actor.optim.warmup_style"),
        ((0, 6), "actor_rollout_ref.actor.optim.lr_scheduler_type"),
    ],
    "reward_manager": [
        ((0,), "reward_model.reward_manager"),
        ((0, 7, 1), "reward.reward_manager.name"),
    ],
    "reward_function_path": [
        ((0,), "custom_reward_function.path"),
        ((0, 7, 1), "reward.custom_reward_function.path"),
    ],
    "reward_function_name": [
        ((0,), "custom_reward_function.name"),
        ((0, 7, 1), "reward.custom_reward_function.name"),
    ],
}

# Hydra's config store is process-global: one initialisation at a time, shared by nested users
# (a validate_with_verl inside an open VerlValidator reuses it instead of deadlocking).
_lock = threading.RLock()
#: the overrides a compose check names in its one line, at most
_MAX_REFUSED_KEYS = 20
#: verl's config without overrides but its config groups chosen, by (config name, groups)
_DEFAULTS: dict[tuple[str, ...], Any] = {}
_depth = 0
_warned_missing = False


def _parse_version(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):  # "1rc2": stop after the numeric head
            break
    return tuple(parts)


def key_for(name: str, version: str | None = None) -> str:
    """verl's config path for a knob that moved between releases (default: installed verl)."""
    if name not in _MOVED_KEYS:
        raise KeyError(
            f"name must be one of {sorted(_MOVED_KEYS)}, but got {name!r}. Use one of those."
        )
    version = version or verl_version() or "0.9.1"
    parsed = _parse_version(version)
    key = _MOVED_KEYS[name][0][1]
    for since, candidate in _MOVED_KEYS[name]:
        if parsed >= since:
            key = candidate
    return key


@functools.lru_cache(maxsize=1)
def verl_version() -> str | None:
    """The installed verl's version, without importing verl (which takes seconds)."""
    from importlib import metadata

    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def verl_available() -> bool:
    """True when verl and hydra can be imported."""
    # Validation reads only local files: a Hugging Face id must never reach the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import hydra  # noqa: F401
        import verl  # noqa: F401
    except Exception as e:  # verl's import chain may raise more than ImportError
        logger.debug("verl is not importable: %s", e)
        return False
    return True


@functools.lru_cache(maxsize=1)
def verl_config_available() -> bool:
    """True when Hydra and verl's config directory are here: enough to compose a config (which
    keys verl has) without importing verl, whose torch and tensordict take ~5 s a process."""
    try:
        import hydra  # noqa: F401
    except Exception as e:
        logger.debug("hydra is not importable: %s", e)
        return False
    found = _find_config_dir()
    return found is not None and os.path.isfile(os.path.join(found, "ppo_trainer.yaml"))


def _find_config_dir() -> str | None:
    """verl's ``trainer/config`` directory, found without importing verl."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


def _config_dir() -> str:
    found = _find_config_dir()
    if found is None:
        raise ModuleNotFoundError("verl is not installed here")
    return found


class VerlValidator:
    """One Hydra initialisation of verl's config directory, reused for many configs.

    Use as a context manager (``with VerlValidator() as v: v.validate(cfg)``); Hydra's global
    state is released on exit, so other code may initialise Hydra afterwards.
    """

    def __init__(self, *, config_name: str = "ppo_trainer") -> None:
        self.config_name = config_name
        #: the last config composed in full and its composed form (the base of a stage's configs)
        self._composed: tuple[dict[str, Any], Any] | None = None
        #: that config's sections as verl instantiated them (their problems), and the keys each
        #: one's interpolations read: a config that changes none of them reuses the result
        self._sections: dict[str, list[str]] = {}
        self._section_deps: dict[str, tuple[str, ...]] = {}
        self._context: Any = None
        self._entered = False

    def __enter__(self) -> "VerlValidator":
        global _depth
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        _lock.acquire()
        try:
            if _depth == 0:
                GlobalHydra.instance().clear()  # a stale initialisation would make ours fail
                self._context = initialize_config_dir(config_dir=_config_dir(), version_base=None)
                self._context.__enter__()
            _depth += 1
            self._entered = True
        except BaseException:
            _lock.release()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _depth
        try:
            _depth -= 1
            if self._context is not None:
                self._context.__exit__(exc_type, exc, tb)
        finally:
            self._context = None
            self._entered = False
            _lock.release()

    def validate(self, config: Mapping[str, Any]) -> list[str]:
        """Problems verl finds in ``config`` (flat dotted keys); [] when verl accepts it.

        A config that differs from the last one composed only in plain keys (a stage's
        suggestions over its base) is composed from that one with Hydra's own override step
        (about a third of the time of a full compose); any other config is composed in full."""
        if not self._entered:
            raise RuntimeError("VerlValidator must be entered (with VerlValidator() as v) before validate.")
        from hydra import compose

        config = dict(config)
        try:
            overrides = to_overrides(config)
        except ValueError as e:
            return [f"override: {e}"]
        cfg = self._compose_from_last(config)
        if cfg is not None:
            last, _ = self._composed  # type: ignore[misc]
            changed = {k for k in config if last.get(k) != config[k]}
            reuse = {name: found for name, found in self._sections.items()
                     if not any(_touches(key, name, self._section_deps.get(name, ())) for key in changed)}
            return self._type_problems(config) + _validate_composed(cfg, reuse=reuse)
        if cfg is None:
            try:
                cfg = compose(self.config_name, overrides=overrides)
            except Exception as e:
                from verl_sweep.verl_knowledge.verl_messages import compose_problem

                return [compose_problem(e, config, self._defaults_for(config), config_dir=_config_dir())]
            self._composed = (config, cfg)
            import copy

            self._section_deps = _section_dependencies(cfg)
            cfg = copy.deepcopy(cfg)
            self._sections = {}
            return self._type_problems(config) + _validate_composed(cfg, record=self._sections)
        return []  # unreachable: cfg is composed above

    def compose_problem(self, config: Mapping[str, Any]) -> str | None:
        """Why verl's Hydra refuses to compose ``config`` (a key verl lacks, ``+`` on a key it
        has, an unknown group option), or None: what verl's launcher would stop on first. Hydra
        stops at one override; the others it would refuse too (a script written for an older
        verl often has several) are named in the same line, so that one pass fixes them all."""
        if not self._entered:
            raise RuntimeError("VerlValidator must be entered (with VerlValidator() as v) before compose_problem.")
        from hydra import compose

        from verl_sweep.verl_knowledge.verl_messages import compose_problem, refused_key

        config = dict(config)
        first: str | None = None
        more: list[str] = []
        for _ in range(_MAX_REFUSED_KEYS):
            try:
                compose(self.config_name, overrides=to_overrides(config))
                break
            except ValueError as e:  # a value no override can carry
                return first or f"override: {e}"
            except Exception as e:
                key = refused_key(e)
                if first is None:
                    first = compose_problem(e, config, self._defaults_for(config), config_dir=_config_dir())
                else:
                    more.append(f"`{key}`" if key else "")
                if key is None or key not in config:
                    break
                del config[key]
        more = [m for m in more if m]
        if first and more:
            first += f" (and {len(more)} more override{'s' * (len(more) > 1)} verl refuses: {', '.join(more)})"
        return first

    def _compose_from_last(self, config: dict[str, Any]) -> Any:
        """``config`` composed as the last full composition plus the keys that differ, or None
        when that is not exactly what Hydra would compose (a config group changes, a key
        is dropped, or Hydra's private override step is not there)."""
        if self._composed is None:
            return None
        import copy

        last, composed = self._composed
        if set(last) - set(config) or any(k in _group_keys() for k in config if config[k] != last.get(k)):
            return None
        diff = {k: v for k, v in config.items() if k not in last or last[k] != v}
        try:
            from hydra._internal.config_loader_impl import ConfigLoaderImpl
            from hydra.core.override_parser.overrides_parser import OverridesParser

            cfg = copy.deepcopy(composed)
            ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(to_overrides(diff)), cfg)
        except Exception as e:  # refused (a key verl lacks) or Hydra moved: the full path says why
            logger.debug("composing from the last config failed (%s); composing in full", e)
            return None
        return cfg

    def _defaults_for(self, config: Mapping[str, Any]) -> Any:
        """verl's defaults with the config's groups chosen (the Megatron actor has other keys);
        composed once a process (verl's config files do not change while it runs)."""
        from hydra import compose

        groups = (self.config_name, *sorted(f"{k}={config[k]}" for k in config if k in _group_keys()))
        if groups not in _DEFAULTS:
            try:
                _DEFAULTS[groups] = compose(self.config_name, overrides=list(groups[1:]))
            except Exception:
                _DEFAULTS[groups] = compose(self.config_name, overrides=[])
        return _DEFAULTS[groups]

    def _type_problems(self, config: Mapping[str, Any]) -> list[str]:
        """Values whose kind differs from verl's default for the key: a string where verl has
        a number (an lr of "abc" composes, and verl's checks do not look), a non-boolean where
        it has a boolean, a mapping where it has one string (a model path of ``{}`` composes
        too, and fails only when the run starts). ``+key`` settings have no default and are
        not checked."""
        from omegaconf import OmegaConf

        defaults = self._defaults_for(config)
        problems = []
        for key, value in sorted(config.items()):
            if key.startswith("+") or value is None:
                continue
            default = OmegaConf.select(defaults, key, default=None, throw_on_missing=False)
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    problems.append(f"{key}: must be true or false (verl's default is {default}), but got {value!r}")
            elif isinstance(default, str):
                # Not a list: some string settings take lists (data.train_files: several
                # files), and which do is in verl's config dataclasses, whose modules import
                # torch (12 s and more a process).
                if isinstance(value, Mapping):
                    problems.append(f"{key}: must be a single value (verl's default is {default!r}), but got {value!r}")
            elif isinstance(default, (int, float)):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    if isinstance(value, str) and _field_takes_string(defaults, key):
                        continue  # e.g. rollout_is_threshold: str | float ("0.5_4.0", IcePop's bounds)
                    problems.append(f"{key}: must be a number (verl's default is {default}), but got {value!r}")
        return problems


def _field_takes_string(defaults: Any, key: str) -> bool:
    """Whether the config dataclass verl builds for ``key`` (the nearest section with a
    ``_target_``, then down its fields' dataclass types) types the field as taking a string
    too (``rollout_is_threshold: str | float``)."""
    import dataclasses
    import importlib
    import typing

    from omegaconf import OmegaConf

    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        target = OmegaConf.select(defaults, ".".join(parts[:depth]) + "._target_", default=None)
        if isinstance(target, str) and "." in target:
            break
    else:
        return False
    module, _, name = target.rpartition(".")
    try:
        hint: Any = getattr(importlib.import_module(module), name)
        for field in parts[depth:]:
            if not dataclasses.is_dataclass(hint):
                return False
            hint = typing.get_type_hints(hint).get(field)
            options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            hint = next((a for a in options if dataclasses.is_dataclass(a)), hint)
    except Exception:  # a target that cannot be imported here: keep the number check
        return False
    return hint is str or str in typing.get_args(hint)


@functools.lru_cache(maxsize=1)
def _group_keys() -> frozenset[str]:
    """Top-level override keys that choose a config group (``model_engine=megatron``)."""
    root = _config_dir()
    return frozenset(name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name)))


#: the sections verl instantiates after validate_config (the trainer and workers, in order)
_SECTIONS = ("actor_rollout_ref.rollout", "algorithm", "actor_rollout_ref.ref", "actor_rollout_ref.model")
_INTERPOLATION = re.compile(r"\$\{(?:oc\.select:)?([A-Za-z_][\w.]*)")


def _section_dependencies(cfg: Any) -> dict[str, tuple[str, ...]]:
    """The keys each section's interpolations read (``${oc.select:actor_rollout_ref.actor.
    use_dynamic_bsz,false}``), besides the section's own: what a change must touch for the
    section to come out differently."""
    from omegaconf import OmegaConf

    deps: dict[str, tuple[str, ...]] = {}
    for name in _SECTIONS:
        node = OmegaConf.select(cfg, name)
        if node is None:
            continue
        text = str(OmegaConf.to_container(node, resolve=False))
        found = set(_INTERPOLATION.findall(text))
        if name == "actor_rollout_ref.ref":  # rebuilt from the actor's fields (_ref_as_worker_builds_it)
            found |= {"actor_rollout_ref.actor"}
        deps[name] = tuple(sorted(found))
    return deps


def _touches(key: str, section: str, deps: tuple[str, ...]) -> bool:
    key = key.lstrip("+")
    if "." not in key:  # a config group or top-level key: anything may change
        return True
    return any(key == d or key.startswith(d + ".") or d.startswith(key + ".") for d in (section, *deps))


def _validate_composed(cfg: Any, *, reuse: Mapping[str, list[str]] | None = None,
                       record: dict[str, list[str]] | None = None) -> list[str]:
    """verl's checks on a composed config: ``validate_config``, then the sections the trainer
    instantiates. A section in ``reuse`` (unchanged from a config checked before) takes its
    earlier result; ``record`` collects each section's result."""
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    problems: list[str] = []
    sink = io.StringIO()
    # validate_config prints its verdict; library code must not write to the console.
    with contextlib.redirect_stdout(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            use_ref = need_reference_policy(cfg)
            use_critic = need_critic(cfg)
            if use_critic:
                _local_critic_model(cfg)
            _validate_config_here(cfg, validate_config, use_ref, use_critic)
        except Exception as e:
            return [f"verl validate_config: {one_line(e)}"]

        # What the trainer and workers instantiate later, in the order they do it.
        sections: list[tuple[str, Any]] = [
            ("actor_rollout_ref.rollout", lambda: cfg.actor_rollout_ref.rollout),
            ("algorithm", lambda: cfg.algorithm),
        ]
        if use_ref:
            sections.append(("actor_rollout_ref.ref", lambda: _ref_as_worker_builds_it(cfg)))
        model_path = cfg.actor_rollout_ref.model.get("path")
        if isinstance(model_path, str) and os.path.isdir(os.path.expanduser(model_path)):
            sections.append(("actor_rollout_ref.model", lambda: cfg.actor_rollout_ref.model))
        for name, node in sections:
            if reuse is not None and name in reuse:
                problems += reuse[name]
                continue
            found: list[str] = []
            try:
                omega_conf_to_dataclass(node())
            except Exception as e:
                found.append(f"verl {name}: {one_line(e)}")
            problems += found
            if record is not None:
                record[name] = found
        try:
            core_algos.get_adv_estimator_fn(cfg.algorithm.adv_estimator)
        except Exception as e:
            problems.append(f"verl algorithm.adv_estimator: {one_line(e)}")
        if cfg.algorithm.get("use_kl_in_reward", False):
            try:
                core_algos.get_kl_controller(cfg.algorithm.kl_ctrl)
            except Exception as e:
                problems.append(f"verl algorithm.kl_ctrl: {one_line(e)}")
    logger.debug("verl validation output: %s", sink.getvalue().strip())
    return problems


def _validate_config_here(cfg: Any, validate_config: Any, use_ref: bool, use_critic: bool) -> None:
    """verl's ``validate_config``. Its LoRA check asks the installed vLLM for the largest rank it
    serves; without vLLM here (a CPU machine) that check is left to the GPU machine and the
    rest is checked with LoRA's rank set aside."""
    try:
        validate_config(cfg, use_reference_policy=use_ref, use_critic=use_critic)
    except Exception as e:
        if "vllm version None" not in str(e):
            raise
        import copy

        from omegaconf import open_dict

        logger.info("vLLM is not installed here: verl's LoRA rank check is left to the GPU machine")
        trial = copy.deepcopy(cfg)
        with open_dict(trial):
            trial.actor_rollout_ref.model.lora_rank = 0
            if trial.actor_rollout_ref.model.get("lora") is not None:
                trial.actor_rollout_ref.model.lora.rank = 0
        validate_config(trial, use_reference_policy=use_ref, use_critic=use_critic)


def _local_critic_model(cfg: Any) -> None:
    """verl's critic check loads the critic model's config.json and tokenizer. A path that is
    no local directory (a Hugging Face id) would be looked up on the network: it is checked
    against a local stand-in (a tiny config and tokenizer) instead; the critic's batch
    sizes, which the check is about, are the config's own."""
    path = cfg.critic.model.get("path")
    if isinstance(path, str) and os.path.isdir(os.path.expanduser(path)):
        return
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.critic.model.path = _stand_in_model()
        for key in ("tokenizer_path", "hf_config_path"):
            if cfg.critic.model.get(key) is not None and not os.path.isdir(os.path.expanduser(str(cfg.critic.model.get(key)))):
                cfg.critic.model[key] = None


@functools.lru_cache(maxsize=1)
def _stand_in_model() -> str:
    """A model directory verl's config classes can read offline: config.json + a tokenizer."""
    import json
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tempfile.mkdtemp(prefix="verl-sweep-stand-in-model-")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": 4 + i for i in range(60)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 1 << 20}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "num_hidden_layers": 2, "vocab_size": 64, "max_position_embeddings": 1 << 20,
                   "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, f)
    return directory


def _ref_as_worker_builds_it(cfg: Any) -> Any:
    """The ref section rewritten the way verl's engine worker does before instantiating it."""
    import copy

    from omegaconf import open_dict

    ref = copy.deepcopy(cfg.actor_rollout_ref.ref)
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return ref


def validate_with_verl(config: Mapping[str, Any]) -> list[str]:
    """Compose ``config`` with the installed verl and return its problems ([] = accepted).

    Without verl, logs one warning and returns []. For many configs, use
    :class:`VerlValidator` (one Hydra initialisation).
    """
    global _warned_missing
    if not verl_available():
        if not _warned_missing:
            logger.warning("verl is not installed: configs are checked by verl-sweep's own rules only")
            _warned_missing = True
        return []
    with VerlValidator() as validator:
        return validator.validate(config)


def validate_many(configs: list[Mapping[str, Any]]) -> list[list[str]]:
    """:func:`validate_with_verl` for many configs under one Hydra initialisation."""
    if not verl_available():
        return [validate_with_verl(c) for c in configs]
    with VerlValidator() as validator:
        return [validator.validate(c) for c in configs]
