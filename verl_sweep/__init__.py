"""verl-sweep: staged, noise-aware hyperparameter search for verl (GRPO/PPO) runs.

One import name, five packages: ``verl_sweep.search`` (the staged driver, its CLI and the
study database), ``verl_sweep.spaces`` (search spaces), ``verl_sweep.verl_knowledge`` (verl's
keys, defaults, rules, memory model and templates), ``verl_sweep.objectives`` (a probe: launch,
follow, score) and ``verl_sweep.launchers`` (where runs go). In the
repository they are the top-level folders of the same names (pyproject.toml maps them).
"""
from pathlib import Path as _Path

# A source checkout used without installing it (PYTHONPATH=the checkout, as on a lent GPU
# machine) has the packages beside this folder, not in it: look for them there too.
_here = _Path(__file__).resolve().parent
if not (_here / "search").is_dir() and (_here.parent / "search" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # type: ignore[name-defined]  # noqa: F821
