"""Train mode on real verl 0.9.1: builds the study, then checks what its runs did.

    python3 scripts/real_verl/check_train_mode.py study OUT.yaml     # tiny-h200.yaml in train mode
    python3 scripts/real_verl/check_train_mode.py check OUT.yaml DB  # after `verl-sweep run`

Written without a GPU (not run yet); scripts/real_verl/check_train_mode.sh runs it. `check`
exits non-zero unless, in the study's database and its runs' files:
- every run of a learning stage after the first logs its first step at the chain's step + 1
  (verl resumed the chain's checkpoint: the global step from the folder's name);
- every run logs actor/lr equal to its own config's lr (the launcher's rewrite of the branch's
  copy took effect: verl alone keeps the checkpoint's lr), and, with the KL loss on, actor/kl_coef
  equal to its config's kl_loss_coef;
- each stage's branch point is a global_step_N folder that a run of the stage before saved;
- the continuation's model is a global_step_<run_steps> folder holding actor shards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

BRANCH, RUN_STEPS = 12, 40


def study(out: Path) -> None:
    data = yaml.safe_load(Path("studies/tiny-h200.yaml").read_text())
    data["name"] = "tiny-h200-train"
    data["run_steps"] = RUN_STEPS
    # No cost cap: a toy's start-ups dwarf its steps, and the check is that every stage branches.
    data["train"] = {"branch_steps": BRANCH, "max_cost_r": None}
    data["baseline"]["trainer.total_training_steps"] = RUN_STEPS
    data["stages"] = [s for s in data["stages"] if s["space"] in ("kl", "lr")]
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {out}: kl and lr stages, {BRANCH}-step branches, a {RUN_STEPS}-step run")


def check(spec_path: Path, db: str) -> int:
    import optuna

    from verl_sweep.launchers.run_dir import RunDir
    from verl_sweep.search.database.records import StageStudyAttrs, records, stage_study_name
    from verl_sweep.search.engine.continuation import stored_model
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.verl_knowledge import KL_LOSS_COEF, LR, USE_KL_LOSS, merge, setting

    spec = load_study(spec_path)
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
            if not t.run_dir or not RunDir(Path(t.run_dir)).metrics.is_file():
                continue
            config = merge(attrs.base_config or {}, t.overrides)
            lines = [json.loads(x) for x in RunDir(Path(t.run_dir)).metrics.read_text().splitlines() if x.strip()]
            if not lines:
                continue
            if lines[0]["step"] != point.step + 1:
                problems.append(f"{stage.name} trial {t.number}: first step {lines[0]['step']}, not {point.step + 1}")
            want_lr = float(setting(config, LR))
            lrs = {round(float(x["data"]["actor/lr"]) / want_lr, 6) for x in lines if "actor/lr" in x["data"]}
            if lrs != {1.0}:
                problems.append(f"{stage.name} trial {t.number}: actor/lr / its lr {want_lr:g} = {sorted(lrs)}")
            if setting(config, USE_KL_LOSS):
                want_kl = float(setting(config, KL_LOSS_COEF))
                kls = {round(float(x["data"]["actor/kl_coef"]) / want_kl, 6) for x in lines if "actor/kl_coef" in x["data"]}
                if kls and kls != {1.0}:
                    problems.append(f"{stage.name} trial {t.number}: actor/kl_coef / its coef {want_kl:g} = {sorted(kls)}")
    model, _ = stored_model(storage, spec)
    if model is None:
        problems.append("the continuation stored no model")
    elif model.step != RUN_STEPS or not list((Path(model.step_dir) / "actor").glob("model_world_size_*_rank_*.pt")):
        problems.append(f"the model {model.step_dir} (step {model.step}) is not a checkpoint at step {RUN_STEPS}")
    for p in problems:
        print("FAIL", p)
    print("train mode on real verl:", "OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1] == "study":
        study(Path(sys.argv[2]))
    else:
        raise SystemExit(check(Path(sys.argv[2]), sys.argv[3]))
