"""Installing verl-sweep into a verl environment keeps that environment: pip resolves each
install line the README shows (no extras, [verl], …) against this venv, which holds verl and
torch, and would install nothing but verl-sweep. The ranges declared admit the neighbouring releases a verl user
may have, and hold the tested set that scripts/setup.sh installs (constraints.txt)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from support import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML through tomli
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: pip's words when it cannot reach the index (no network on this machine)
OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution"
                     r"|Network is unreachable|No matching distribution found for setuptools")


def _readme_install_lines() -> list[str]:
    section = (REPO / "README.md").read_text().split("## Install into your verl environment", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block under the README's install heading"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _requirements(extra: str | None) -> dict[str, Requirement]:
    specs = PYPROJECT["project"]["dependencies"] if extra is None else PYPROJECT["project"]["optional-dependencies"][extra]
    return {Requirement(s).name.lower(): Requirement(s) for s in specs}


def _pinned() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = Version(version.strip())
    return pins


@pytest.mark.slow
@pytest.mark.parametrize("line", _readme_install_lines())
def test_the_readmes_install_lines_change_nothing_installed(line: str, tmp_path: Path) -> None:
    args = shlex.split(line)
    assert args[:2] == ["pip", "install"] and len(args) == 3 and args[2].startswith("."), (
        f"the README's install lines must read pip install \".[EXTRAS]\", but got {line!r}")
    try:
        held = {name: metadata.version(name) for name in ("verl", "torch")}
    except metadata.PackageNotFoundError as e:
        pytest.skip(f"this venv holds no {e.name}: run `bash scripts/setup.sh` (it installs verl and torch)")
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                             f"{REPO}{args[2][1:]}"], capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and OFFLINE.search(result.stderr):
        pytest.skip(f"PyPI is unreachable (pip builds the package with setuptools from it): {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    installs = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert set(installs) == {"verl-sweep"}, (
        f"pip would install or replace {sorted(set(installs) - {'verl-sweep'})} in an environment holding "
        f"{held}: {installs}")


def test_declared_ranges_admit_a_verl_users_neighbouring_releases() -> None:
    """An exact pin would move the verl, Optuna or Ray a user already has."""
    base, verl, ray = _requirements(None), _requirements("verl"), _requirements("ray")
    for requirement, versions in ((base["optuna"], ("5.0.0", "5.0.1", "5.3.0")),
                                  (verl["verl"], ("0.9.1", "0.9.2", "0.9.9")),
                                  (verl["hydra-core"], ("1.3.2", "1.3.8")),
                                  (verl["omegaconf"], ("2.3.0", "2.3.1")),
                                  (ray["ray"], ("2.41.0", "2.60.0", "2.70.0"))):
        refused = [v for v in versions if not requirement.specifier.contains(v)]
        assert not refused, f"{requirement} must admit {', '.join(versions)}, but refuses {', '.join(refused)}"


def test_the_tested_set_lies_inside_the_declared_ranges() -> None:
    """scripts/setup.sh installs constraints.txt's pins: each must be a version pyproject.toml allows."""
    pins = _pinned()
    extras = PYPROJECT["project"]["optional-dependencies"]
    declared = [_requirements(None), *(_requirements(extra) for extra in extras if extra != "bench")]
    checked = 0
    for requirements in declared:
        for name, requirement in requirements.items():
            if name in pins:
                checked += 1
                assert requirement.specifier.contains(pins[name]), (
                    f"{requirement} must hold the tested {name}=={pins[name]} (constraints.txt)")
    assert checked >= 10, f"only {checked} requirements found in constraints.txt"
    assert "-c constraints.txt" in (REPO / "scripts" / "setup.sh").read_text()


def test_one_import_name_lands_in_site_packages(tmp_path: Path) -> None:
    """Installed into a fresh target, verl-sweep adds ``verl_sweep`` (every module of its four
    folders inside it) and its metadata, nothing else: generic top-level names such as
    ``spaces`` or ``objectives`` would overwrite other projects' packages of those names."""
    # From a copy of the checkout's files: a build in the checkout would leave build/ there, and
    # a build/ left by an earlier one would ship modules since removed.
    source = tmp_path / "source"
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    target = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", str(target), str(source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    top = {p.name for p in target.iterdir()} - {"bin"}
    assert {name for name in top if not name.endswith(".dist-info")} == {"verl_sweep"}, sorted(top)
    installed = {p.relative_to(target / "verl_sweep").as_posix() for p in (target / "verl_sweep").rglob("*.py")}
    ours = {f"{folder}/{p.relative_to(REPO / folder).as_posix()}" for folder in ("search", "spaces", "objectives", "launchers")
            for p in (REPO / folder).rglob("*.py")}
    assert ours - installed == set(), "pyproject.toml's package list misses these"
    probe = subprocess.run([sys.executable, "-c", "import verl_sweep.search.commands.cli, verl_sweep.launchers.simulator;"
                            "print(verl_sweep.search.commands.cli.__file__, verl_sweep.launchers.simulator.shipped_landscapes()[:1])"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr[-2000:]
    where, landscapes = probe.stdout.split(" ", 1)
    assert where.startswith(str(target)) and landscapes.strip() != "[]", probe.stdout  # the installed copy, its data
