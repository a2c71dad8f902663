"""Launchers own their options (``Launcher.OPTIONS``): the declared options are the
constructor's, one registry (``launchers.LAUNCHERS``) names the kinds, and the study file, the
CLI and ``validate`` all check a study's options through ``verl_sweep.search.commands.launch``."""

from __future__ import annotations

import inspect

import pytest

from support import cli, demo_data
from verl_sweep.launchers import LAUNCHERS
from verl_sweep.launchers.options import Option, OptionError, describe, resolve
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.commands.launch import launcher_options, launcher_problems
from verl_sweep.search.spec.study_file import parse_study

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("kind", sorted(LAUNCHERS))
def test_a_launcher_declares_exactly_its_constructor_s_options(kind: str) -> None:
    cls = LAUNCHERS[kind]
    parameters = {name: p for name, p in inspect.signature(cls.__init__).parameters.items()
                  if p.kind is p.KEYWORD_ONLY and name != "clock"}
    assert [o.name for o in cls.OPTIONS] == list(parameters)
    required = {name for name, p in parameters.items() if p.default is p.empty}
    assert {o.name for o in cls.OPTIONS if o.required} == required


def test_options_are_checked_by_their_declared_type() -> None:
    declared = (Option("n", "int"), Option("rate", "float"), Option("ids", "list[int]", nullable=True),
                Option("slots", "int", required=True, from_study="launcher.max_concurrent"))
    options, dropped = resolve("x", declared, {"n": 3, "rate": 2, "ids": None}, study={"launcher.max_concurrent": 4})
    assert options == {"n": 3, "rate": 2, "ids": None, "slots": 4} and dropped == []
    with pytest.raises(OptionError, match=r"^launcher\.options\.n: must be an integer, but got True\. See the README"):
        resolve("x", declared, {"n": True}, study={})
    with pytest.raises(OptionError, match=r"^launcher\.options\.ids: must be a list of integers, but got \[1, 'a'\]"):
        resolve("x", declared, {"ids": [1, "a"]}, study={})
    with pytest.raises(OptionError, match=r"^launcher\.options: the x launcher takes ids, n, rate, slots, but got 'm'"):
        resolve("x", declared, {"m": 1}, study={})
    assert resolve("x", declared, {"m": 1}, study={}, drop_unknown=True) == ({}, ["m"])
    assert describe(declared)[-1] == "slots (int, default: the study's launcher.max_concurrent)"


def test_a_study_s_launcher_is_checked_before_it_is_built() -> None:
    data = demo_data()
    data["launcher"] = {"kind": "replay", "max_concurrent": 3, "options": {"landscape": "kl_edge"}}
    spec = parse_study(data)
    assert launcher_options(spec, "replay") == {"landscape": "kl_edge", "max_concurrent": 3, "gpus_per_probe": 8}
    assert launcher_problems(spec) == []
    dropped: list[str] = []
    with pytest.raises(BadInputError, match=r"^launcher\.options: the ray launcher needs address, but the study"):
        launcher_options(spec, "ray", on_dropped=dropped.append)
    assert dropped == ["--launcher ray: leaving out the study's replay options landscape (ray takes address, command, "
                       "extra_env, gpus_per_probe, log_mirror_interval_s, max_concurrent, shared_dir, slot_resource, "
                       "stop_timeout_s)."]
    data["launcher"]["options"] = {"landscape": "nowhere"}
    (problem,) = launcher_problems(parse_study(data))
    assert problem.startswith("launcher.options.landscape: ")
    with pytest.raises(BadInputError, match=r"launcher kind must be one of local, ray, replay, sim, but got 'slurm'"):
        launcher_options(spec, "slurm")


def test_the_study_file_knows_the_registered_kinds() -> None:
    data = demo_data()
    data["launcher"] = {"kind": "slurm"}
    with pytest.raises(BadInputError, match=r"launcher\.kind: must be 'sim', 'local', 'ray' or 'replay', but got 'slurm'"):
        parse_study(data)


def test_help_lists_every_launcher_kind() -> None:
    for command in ("run", "resume", "worker"):
        result = cli(command, "--help")
        assert result.returncode == 0
        assert all(kind in " ".join(result.stdout.split()) for kind in LAUNCHERS), result.stdout
