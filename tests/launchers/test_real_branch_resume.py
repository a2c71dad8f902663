"""The simulator resumes a branch as real verl 0.9.1 did on an H100 (2026-12-07,
docs/device-runs/2026-12-07-h100-branch-resume): the same command lines, run by the simulated
verl process on the tiny world, log the same steps, lr, KL coefficients and Adam step counts as
the real runs logged. Where they part, the real run is the reference: this test fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support import REPO

from verl_sweep.launchers.base import Branch
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.launchers.simulator import checkpoints
from verl_sweep.launchers.verl_checkpoints import prepare_branch

pytestmark = pytest.mark.fast

RECORD = REPO / "docs" / "device-runs" / "2026-12-07-h100-branch-resume"
WORLD = REPO / "scripts" / "real_verl" / "tiny_h200.landscape.yaml"
#: what each run's metrics must agree on, step by step
KEYS = ("actor/lr", "actor/kl_coef")


def _real(name: str) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (RECORD / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["data"] for r in rows}


def _simulate(tmp: Path, name: str, commands: dict[str, list[str]], **paths: Path) -> dict[int, dict[str, Any]]:
    """One recorded run through the simulated verl process, its paths under ``tmp``."""
    def fill(arg: str) -> str:
        for key, path in {"DATA": tmp / "data", **paths}.items():
            arg = arg.replace(f"${key}", str(path))
        return arg

    metrics = tmp / f"{name}.jsonl"
    argv = [fill(a) for a in [*commands["common"], *commands[name]]] + [
        f"trainer.default_local_dir={tmp / name / 'ckpt'}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}"]
    env = {**os.environ, "VERL_SIM_LANDSCAPE": str(WORLD), "VERL_SIM_TIME_SCALE": "1000000"}
    proc = subprocess.run([sys.executable, "-m", "verl_sweep.launchers.simulator", *argv], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {r["step"]: r["data"] for r in map(json.loads, metrics.read_text().splitlines())}


def _adam_steps(tmp: Path, name: str, step: int) -> int:
    one_gpu = {"trainer.n_gpus_per_node": 1, "trainer.nnodes": 1}
    return checkpoints.load(tmp / name / "ckpt" / f"global_step_{step}", one_gpu, step=step).optimizer_steps


def test_the_simulator_resumes_branches_as_real_verl_did(tmp_path: Path) -> None:
    commands = json.loads((RECORD / "commands.json").read_text())
    sim = {"base": _simulate(tmp_path, "base", commands)}
    ckpt = tmp_path / "base" / "ckpt" / "global_step_4"
    # The lr-patched branch resumes from its own copy, the lr rewritten as the launchers rewrite
    # a branch's copy (real verl's shards: the same arithmetic as the device run's rewrite)
    patched = prepare_branch(Branch(resume_from=str(ckpt), save_every=100, lr=3e-5), RunDir(tmp_path / "patched"))
    assert patched is not None
    for name in ("lr-plain", "lr-patched", "mb-kl"):
        sim[name] = _simulate(tmp_path, name, commands, CKPT=ckpt, PATCHED=patched)

    for name, simulated in sim.items():
        real = _real(name)
        assert sorted(simulated) == sorted(real), name  # base 1-4; each branch 5-7 (the step from the folder)
        for step, data in real.items():
            for key in KEYS:
                assert simulated[step][key] == pytest.approx(data[key], rel=1e-6), (name, step, key)
    # The config's lr 3e-4 never applies to a plain resume: the checkpoint's 1e-4 does.
    assert _real("lr-plain")[5]["actor/lr"] == pytest.approx(1e-4)
    # verl keeps no in-reward KL controller: every branch restarts it at its config's kl_coef,
    # not at the 0.001152 the base run's controller had reached.
    for name, coef in (("lr-plain", 0.001), ("lr-patched", 0.001), ("mb-kl", 0.005)):
        assert _real(name)[5]["actor/reward_kl_penalty_coeff"] == pytest.approx(coef)
        assert sim[name][5]["actor/reward_kl_penalty_coeff"] == pytest.approx(coef)
    assert _real("base")[4]["actor/reward_kl_penalty_coeff"] != pytest.approx(0.001)
    # A run's first step, fresh or resumed, carries a fixed extra (real: +23.5 to +24.2 s here)
    for name, first in (("base", 1), ("lr-plain", 5), ("lr-patched", 5), ("mb-kl", 5)):
        def extra(run: dict[int, dict[str, Any]]) -> float:
            later = sorted(run[s]["timing_s/step"] for s in run if s != first)
            return run[first]["timing_s/step"] - later[len(later) // 2]
        assert extra(sim[name]) == pytest.approx(extra(_real(name)), rel=0.3), name
    # Adam's step count goes on from the checkpoint, one a mini-batch (real: 4, 7, 7, 16)
    assert [_adam_steps(tmp_path, n, s) for n, s in (("base", 4), ("lr-plain", 7), ("lr-patched", 7), ("mb-kl", 7))] \
        == [4, 7, 7, 16]
