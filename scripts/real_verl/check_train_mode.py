"""Train mode on real verl 0.9.1: builds the study, then checks what its runs did.

    python3 scripts/real_verl/check_train_mode.py study OUT.yaml [adaptive-kl] [quick] [spaces=kl,lr]  # tiny-h200.yaml in train mode
    python3 scripts/real_verl/check_train_mode.py check OUT.yaml DB  # after `verl-sweep run`

scripts/real_verl/check_train_mode.sh runs it. ``quick``: one incumbent run and one candidate a
stage, no confirmation, 11-step branches and a continuation of 2 steps: each stage one wave of
start-ups. ``spaces=kl``: the stages of those spaces alone (default kl,lr). `check`
exits non-zero unless, in the study's database and its runs' files:
- every run of a learning stage after the first logs its first step at the chain's step + 1
  (verl resumed the chain's checkpoint: the global step from the folder's name);
- every run logs actor/lr equal to its own config's lr (the launcher's rewrite of the branch's
  copy took effect: verl alone keeps the checkpoint's lr), and, with the KL loss on, actor/kl_coef
  equal to its config's kl_loss_coef;
- with in-reward KL on (``adaptive-kl``: an adaptive controller in the baseline), every run
  logs at its first step the coefficient it was meant to start from: the chain's controller
  value at the checkpoint where it keeps the chain's settings (verl alone restarts it at
  kl_ctrl.kl_coef), its own kl_coef where it changes them;
- each stage's branch point is a global_step_N folder that a run of the stage before saved;
- the continuation's model is a global_step_<run_steps> folder holding actor shards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

def study(out: Path, adaptive_kl: bool = False, quick: bool = False, spaces: tuple[str, ...] = ("kl", "lr")) -> None:
    branch = 11 if quick else 12  # 11: warm-up 1 + the 10 scored steps of a score
    run_steps = len(spaces) * branch + (2 if quick else 16)
    data = yaml.safe_load(Path("studies/tiny-h200.yaml").read_text())
    data["name"] = "tiny-h200-train"
    data["run_steps"] = run_steps
    # No cost cap: a toy's start-ups dwarf its steps, and the check is that every stage branches.
    data["train"] = {"branch_steps": branch, "max_cost_r": None}
    data["baseline"]["trainer.total_training_steps"] = run_steps
    data["stages"] = [s for s in data["stages"] if s["space"] in spaces]
    if quick:
        data["probe"]["incumbent_repeats"] = 1
        for s in data["stages"]:
            s.update(budget={"max_trials": 2}, confirm_top=0)  # the incumbent and one candidate
    if adaptive_kl:
        data["baseline"].update({"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
                                 "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.target_kl": 0.01})
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {out}: {' and '.join(spaces)} stage(s), {branch}-step branches, a {run_steps}-step run")


def _kl_start(point: Any, config: dict[str, Any], chain: dict[str, Any]) -> float:
    """The in-reward KL coefficient a run of ``config`` branching from ``point`` must log at its
    first step, worked out here from verl's AdaptiveKLController.update (not from verl-sweep's
    code, which this checks): the chain's controller moved on from the coefficient and KL its
    run logged at the checkpoint's step, where the run keeps the chain's settings; else its own
    kl_coef (verl restarts the controller there)."""
    from verl_sweep.verl_knowledge import setting

    keys = ["algorithm.use_kl_in_reward", "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef",
            "algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"]
    own = float(setting(config, "algorithm.kl_ctrl.kl_coef"))
    if point.step_dir is None or setting(config, "algorithm.kl_ctrl.type") != "adaptive" or \
            any(setting(config, k) != setting(chain, k) for k in keys):
        return own
    rows = [json.loads(x) for x in (Path(point.step_dir).parents[1] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    at = next(r["data"] for r in rows if r["step"] == point.step)
    error = min(max(at["actor/reward_kl_penalty"] / float(setting(config, "algorithm.kl_ctrl.target_kl")) - 1, -0.2), 0.2)
    responses = int(setting(config, "data.train_batch_size")) * int(setting(config, "actor_rollout_ref.rollout.n"))
    return at["actor/reward_kl_penalty_coeff"] * (1 + error * responses / float(setting(config, "algorithm.kl_ctrl.horizon")))


def _run_problems(label: str, run_dir: Path, point: Any, config: dict[str, Any], chain: dict[str, Any]) -> list[str]:
    """What a run of ``config`` branched from ``point`` did against what it must have done."""
    from verl_sweep.launchers.run_dir import RunDir
    from verl_sweep.verl_knowledge import KL_LOSS_COEF, LR, USE_KL_IN_REWARD, USE_KL_LOSS, setting

    metrics = RunDir(run_dir).metrics
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    if not lines:
        return []
    problems = []
    if lines[0]["step"] != point.step + 1:
        problems.append(f"{label}: first step {lines[0]['step']}, not {point.step + 1}")
    want_lr = float(setting(config, LR))
    lrs = {round(float(x["data"]["actor/lr"]) / want_lr, 6) for x in lines if "actor/lr" in x["data"]}
    if lrs != {1.0}:
        problems.append(f"{label}: actor/lr / its lr {want_lr:g} = {sorted(lrs)}")
    if setting(config, USE_KL_LOSS):
        want_kl = float(setting(config, KL_LOSS_COEF))
        kls = {round(float(x["data"]["actor/kl_coef"]) / want_kl, 6) for x in lines if "actor/kl_coef" in x["data"]}
        if kls and kls != {1.0}:
            problems.append(f"{label}: actor/kl_coef / its coef {want_kl:g} = {sorted(kls)}")
    if setting(config, USE_KL_IN_REWARD):
        want = _kl_start(point, config, chain)
        first = lines[0]["data"].get("actor/reward_kl_penalty_coeff")
        if first is None or abs(float(first) / float(want) - 1) > 1e-6:
            problems.append(f"{label}: reward KL coefficient {first} at its first step, not {want:g}")
    return problems


def check(spec_path: Path, db: str) -> int:
    import optuna

    from verl_sweep.search.database.records import StageStudyAttrs, records, stage_study_name
    from verl_sweep.search.engine.continuation import continuation_study_name, stored_model, stored_start
    from verl_sweep.search.method.run_length import run_steps_of
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.verl_knowledge import merge

    spec = load_study(spec_path)
    run_steps = run_steps_of(spec)
    storage = optuna.storages.RDBStorage(db)
    problems: list[str] = []
    for stage in spec.stages:
        study = optuna.load_study(study_name=stage_study_name(spec, stage), storage=storage)
        attrs = StageStudyAttrs.of(study.user_attrs)
        point = attrs.branch
        if point is None:
            problems.append(f"{stage.name}: no branch point stored")
            continue
        if point.step_dir is not None and not Path(point.step_dir).is_dir():
            problems.append(f"{stage.name}: its branch point {point.step_dir} is missing")
        for t in records(study.get_trials(deepcopy=False)):
            if t.run_dir:
                problems += _run_problems(f"{stage.name} trial {t.number}", Path(t.run_dir), point,
                                          merge(attrs.base_config or {}, t.overrides), attrs.base_config or {})
    model, attempts = stored_model(storage, spec)
    start = stored_start(storage, spec)
    if attempts and start is not None and attempts[0].run_dir:  # the continuation goes on as the chain's run did
        chain = optuna.load_study(study_name=continuation_study_name(spec), storage=storage).user_attrs["config"]
        problems += _run_problems("the continuation", Path(attempts[0].run_dir), start, chain, chain)
    if model is None:
        problems.append("the continuation stored no model")
    elif model.step != run_steps or not list((Path(model.step_dir) / "actor").glob("model_world_size_*_rank_*.pt")):
        problems.append(f"the model {model.step_dir} (step {model.step}) is not a checkpoint at step {run_steps}")
    for p in problems:
        print("FAIL", p)
    print("train mode on real verl:", "OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1] == "study":
        args = sys.argv[3:]
        spaces = tuple(a.removeprefix("spaces=").split(",") for a in args if a.startswith("spaces="))
        study(Path(sys.argv[2]), adaptive_kl="adaptive-kl" in args, quick="quick" in args,
              **({"spaces": tuple(spaces[0])} if spaces else {}))
    else:
        raise SystemExit(check(Path(sys.argv[2]), sys.argv[3]))
