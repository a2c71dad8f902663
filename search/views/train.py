"""Train mode as a person reads it (``verl_sweep.search.engine.chain`` explains the mode): the
chain as a tree, each learning stage's branch (the chain's step and checkpoint its runs started
from, the steps they trained, the config it chose, the checkpoint that carried the chain on),
then the continuation and the model; and the schedule the export writes beside the config.

Read-only, like ``verl_sweep.search.views.status``: ``train_status`` is ``study_status``'s
``"train"`` entry (train mode only); the rest turns that entry into text.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import yaml

from verl_sweep.search.database.records import ChainPoint, Decision, StageStudyAttrs
from verl_sweep.search.engine.continuation import TRAIN_STAGE
from verl_sweep.search.spec.errors import BadInputError, SweepError
from verl_sweep.verl_knowledge import Config

if TYPE_CHECKING:
    import optuna

    from verl_sweep.search.spec.study_file import StudySpec

#: the continuation's states (``train_status``'s ``continuation.state``)
WAITING, NOT_STARTED, RUNNING, STOPPED, TRAINED = "waiting", "not started", "running", "stopped", "trained"


def train_status(storage: optuna.storages.BaseStorage, spec: StudySpec, stages: list[dict[str, Any]],
                 stored: dict[str, StageStudyAttrs], *, trial_row: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The chain and the continuation of a train-mode study. ``stages``: ``study_status``'s stage
    entries; ``stored``: the attributes of each stage that opened; ``trial_row``: how status shows
    a trial (the continuation's attempts). A checkpoint is read from what
    the stages and the continuation stored, else (the next stage not opened yet) found as the
    driver finds it (``chain_point``); one not found is None with a ``left_note`` saying why."""
    from verl_sweep.search.engine.chain import chain_point
    from verl_sweep.search.method.stage import Stage

    assert spec.train is not None
    plans = [Stage.of(spec, index) for index in range(len(stages))]
    chain = [_link(plan.index, entry, stored.get(entry["name"]), plan.probe_steps)
             for plan, entry in zip(plans, stages) if plan.branches]
    continuation = _continuation(storage, spec, all(s.get("winner") for s in stages), trial_row)
    points = [link["from"] for link in chain] + [continuation["from"]]
    for i, link in enumerate(chain):
        if link["state"] != "finished":
            continue
        later = [p for p in points[i + 1:] if p is not None and p.get("stage") == link["stage"]]
        if later:
            link["left"] = later[0]
        else:  # the next stage (or the continuation) has not opened yet: where it will branch from
            try:
                point = chain_point(storage, spec, link["index"] + 1)
            except SweepError as e:
                link["left_note"] = str(e)
                continue
            link["left"] = dataclasses.asdict(point) if point.stage == link["stage"] else None
        left_trial = (link["left"] or {}).get("trial")
        link["seed"] = next((r["seed"] for r in stages[link["index"]]["trials"] if r["number"] == left_trial), None)
    if continuation["from"] is None and continuation["state"] == NOT_STARTED:  # where it will start
        lefts = [link["left"] for link in chain if link["state"] == "finished"]
        continuation["from"] = lefts[-1] if lefts else dataclasses.asdict(ChainPoint(step=0))
    return {"branch_steps": spec.train.branch_steps, "run_steps": _run_steps(spec), "chain": chain,
            "continuation": continuation}


def _run_steps(spec: StudySpec) -> int | None:
    from verl_sweep.search.method.run_length import run_steps_of

    try:
        return run_steps_of(spec)
    except BadInputError:
        return None


def _link(index: int, entry: dict[str, Any], attrs: StageStudyAttrs | None, branch_steps: int) -> dict[str, Any]:
    """A learning stage on the chain: where its runs branched from (``from``, a ``ChainPoint``
    as a dict), the steps they trained, what it chose; ``left`` is filled in later."""
    result = entry.get("winner") or {}
    skipped = result.get("decision") == Decision.SKIPPED.value
    link: dict[str, Any] = {
        "stage": entry["name"], "index": index, "state": "skipped" if skipped else entry["state"],
        "from": None, "steps": None,
        "n_runs": sum(1 for r in entry.get("trials", []) if r["state"] not in ("waiting", "skipped")),
        "decision": result.get("decision"), "summary": result.get("summary"), "winner_trial": result.get("winner_trial"),
        "overrides": result.get("overrides") or {}, "left": None, "seed": None,
    }
    if attrs is not None and attrs.branch is not None:
        start = attrs.branch.step
        link["from"] = dataclasses.asdict(attrs.branch)
        link["steps"] = [start + 1, start + (attrs.probe_steps or branch_steps)]
    return link


def _continuation(storage: optuna.storages.BaseStorage, spec: StudySpec, stages_done: bool,
                  trial_row: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """``<study>.train``: its state, the chain point it started from, its attempts (``status``'s
    trial rows), their GPU-hours and the model once trained."""
    from verl_sweep.search.engine.continuation import continuation_study_name, stored_model, stored_start

    name = continuation_study_name(spec)
    model, attempts = stored_model(storage, spec)
    point = stored_start(storage, spec)
    start = None if point is None else dataclasses.asdict(point)
    rows = [trial_row(t, {}) for t in attempts]
    if model is not None:
        state = TRAINED
    elif any(r["state"] == "running" for r in rows):
        state = RUNNING
    elif rows:
        state = STOPPED
    else:
        state = NOT_STARTED if stages_done else WAITING
    return {"study": name, "state": state, "from": start, "to_step": _run_steps(spec), "attempts": rows,
            "gpu_hours": round(sum(r["gpu_time_s"] or 0.0 for r in rows) / 3600.0, 4),
            "model": None if model is None else dataclasses.asdict(model)}


# -- text ---------------------------------------------------------------------------------------


def _step(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def _from_text(point: dict[str, Any] | None) -> str:
    """Where a branch started: "from scratch", or "from step 250 (minibatch trial 0's checkpoint)"."""
    if point is None:
        return "from an unknown step"
    if not point.get("step_dir"):
        return "from scratch"
    who = f"{point['stage']} trial {point['trial']}" if point.get("stage") is not None else "the chain"
    return f"from step {_step(point['step'])} ({who}'s checkpoint)"


def _chose_text(data: dict[str, Any], link: dict[str, Any]) -> str:
    """The config that carried the chain on: the incumbent's, or the winner's changes and η."""
    from verl_sweep.search.views.text import format_params

    if link["winner_trial"] is None:
        return "kept its incumbent's config"
    winner = data["stages"][link["index"]].get("winner") or {}
    eta = "" if winner.get("eta") is None else \
        f", η {winner['eta']:.3f} [{winner['eta_low']:.3f}, {winner['eta_high']:.3f}]"
    return f"chose trial {link['winner_trial']} ({format_params(link['overrides'])}){eta}"


def chain_lines(data: dict[str, Any]) -> list[str]:
    """The chain as ``status`` prints it: a heading, one line a learning stage (its steps, where it
    branched from, its runs, what it chose) with the checkpoint it left on the next line, then the
    continuation and the model. Paths stand whole on lines of their own."""
    train = data["train"]
    c = train["continuation"]
    lines = [f"train mode (the study is the run): each learning stage branches {train['branch_steps']:,}-step runs "
             f"from the chain, its choice carries it on; the continuation trains to step {_step(train['run_steps'])}:"]
    for link in train["chain"]:
        head = f"  {link['stage']}: "
        if link["state"] == "skipped":
            lines.append(head + "skipped (stop_when_flat): the chain goes on without it")
            continue
        if link["steps"] is None:
            lines.append(head + link["state"])
            continue
        first, last = link["steps"]
        runs = f"{link['n_runs']} run{'s' * (link['n_runs'] != 1)}"
        text = f"{head}steps {_step(first)}-{_step(last)} {_from_text(link['from'])}, {runs}"
        if link["state"] != "finished":
            lines.append(f"{text} so far, {link['state']}")
            continue
        lines.append(f"{text}; {_chose_text(data, link)}")
        left = link.get("left")
        if left is not None and left.get("step_dir"):
            seed = "" if link.get("seed") is None else f", seed {link['seed']}"
            lines.append(f"    the chain's checkpoint at step {_step(left['step'])} (trial {left['trial']}{seed}): "
                         f"{left['step_dir']}")
        elif link.get("left_note"):
            lines.append(f"    the chain's checkpoint: not found: {link['left_note']}")
    lines.append("  " + continuation_text(c))
    model = c.get("model")
    lines.append(f"  the model: step {_step(model['step'])}: {model['step_dir']}" if model
                 else "  the model: not trained yet")
    return lines


def continuation_text(c: dict[str, Any]) -> str:
    """One line: the continuation's steps, where it starts from, its state, attempts and cost."""
    start = c.get("from")
    first = None if start is None else start["step"] + 1
    steps = f"steps {_step(first)}-{_step(c['to_step'])}"
    if c["state"] == WAITING:
        return f"continuation: to step {_step(c['to_step'])}, once the stages are done"
    n = len(c["attempts"])
    cost = f"{c['gpu_hours']:,.1f} GPU-h" + ("" if c.get("cost_r") is None else f" = {_r(c['cost_r'])}")
    text = f"continuation: {steps} {_from_text(start)}: {c['state']}"
    if n:
        text += f", {n} attempt{'s' * (n != 1)}, {cost}"
    if c["state"] == STOPPED:
        reason = c["attempts"][-1].get("reason")
        text += (f" (the last: {reason})" if reason else "") + "; `verl-sweep resume` goes on from its last checkpoint"
    return text


def _r(r: float) -> str:
    from verl_sweep.search.views.text import r_text

    return r_text(r)


# -- the schedule the export writes -------------------------------------------------------------


def schedule(data: dict[str, Any], final: Config) -> dict[str, Any]:
    """Which config trained which steps of the model: each finished learning stage's chosen config
    over its branch (the run of it that left the chain's checkpoint), then the continuation's; each
    as its changes from ``final`` (the exported config; None: a key the segment leaves unset), and
    the model's checkpoint (None until trained)."""
    from verl_sweep.search.views.text import rounded

    train = data["train"]
    segments: list[dict[str, Any]] = []
    for link in train["chain"]:
        if link["state"] != "finished" or link["steps"] is None:
            continue
        winner = data["stages"][link["index"]]["winner"]
        left = link.get("left") or {}
        segments.append({"steps": link["steps"], "stage": link["stage"], "trial": left.get("trial"),
                         "seed": link.get("seed"), "from": (link["from"] or {}).get("step_dir"),
                         "checkpoint": left.get("step_dir"), "changes_from_final": _changes(winner["config"], final)})
    c = train["continuation"]
    model = c.get("model")
    if c["state"] != WAITING and c.get("from") is not None:
        trial = model["trial"] if model else (c["attempts"][-1]["number"] if c["attempts"] else None)
        seed = next((r["seed"] for r in c["attempts"] if r["number"] == trial), None)
        segments.append({"steps": [c["from"]["step"] + 1, model["step"] if model else c["to_step"]], "stage": TRAIN_STAGE,
                         "trial": trial, "seed": seed, "from": c["from"].get("step_dir"),
                         "checkpoint": model["step_dir"] if model else None, "state": c["state"],
                         "changes_from_final": {}})
    return rounded({"study": data["study"], "run_steps": train["run_steps"], "branch_steps": train["branch_steps"],
                    "schedule": segments, "model": model["step_dir"] if model else None,
                    "model_step": model["step"] if model else None, "trained": model is not None})


def _changes(config: Config, final: Config) -> Config:
    changed: Config = {k: v for k, v in config.items() if final.get(k) != v}
    changed.update({k: None for k in final if k not in config})
    return dict(sorted(changed.items()))


def schedule_comment(plan: dict[str, Any]) -> list[str]:
    """The schedule in a few comment lines (the config YAML's header): the steps, the stage whose
    config trained them, the changes from this file; then the model."""
    lines = ["train mode: the study trains the model; which config trained which steps:"]
    for s in plan["schedule"]:
        changes = ", ".join(f"{k}={'unset' if v is None else v}" for k, v in s["changes_from_final"].items())
        first, last = s["steps"]
        stage = "continuation" if s["stage"] == TRAIN_STAGE else s["stage"]
        who = f"{stage} trial {s['trial']}" if s["trial"] is not None else stage
        state = "" if s.get("state", TRAINED) == TRAINED else f", {s['state']}"
        lines.append(f"  steps {first:,}-{_step(last)} ({who}{state}): "
                     + (f"this config with {changes}" if changes else "this config"))
    lines.append(f"model: {plan['model']}" if plan["trained"] else
                 "model: not trained yet; `verl-sweep resume` trains it to the run's end")
    return lines


def schedule_yaml(plan: dict[str, Any], *, config_file: str | None = None) -> str:
    """The schedule file written next to the config (``export -o best.yaml``: ``best.schedule.yaml``)."""
    head = [f"verl-sweep train-mode schedule of study '{plan['study']}': which config trained which steps",
            "each segment's config: " + (config_file or "the exported config") + " with its changes_from_final "
            "(null: the key left unset, verl's default)",
            "from: the checkpoint the segment's run started from (null: from scratch); checkpoint: the one it left"]
    if not plan["trained"]:
        head.append("the model is not trained yet: `verl-sweep resume` trains it to the run's end")
    # flow style for the leaves only: ``steps: [1, 250]``, ``changes_from_final: {…}``
    return "".join(f"# {line}\n" for line in head) + yaml.safe_dump(plan, sort_keys=False, default_flow_style=None,
                                                                      width=10_000)
