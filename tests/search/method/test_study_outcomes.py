"""What a whole study does, measured on the simulator's dynamics in simulated time (the replay
launcher: the simulator's model without processes, so a study takes seconds)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from support import REPO, cli, demo_data, write_study


def _replay_demo(tmp_path: Path, name: str, change: Any = None) -> dict[str, Any]:
    data = copy.deepcopy(demo_data())
    data["name"] = name
    # The modelled metrics only (what the scorer and the health checks read: the same study,
    # less to write and parse), and no final check (tests/search/engine/test_final_check.py has it).
    data["launcher"] = {"kind": "replay", "max_concurrent": 2, "options": {"verl_record": False}}
    data["final_check"] = False
    for stage in data["stages"]:
        stage["sampler"] = {"seed": 7}  # the same suggestions in both studies until pruning differs
    if change:
        change(data)
    path = write_study(tmp_path, data, f"{name}.yaml")
    result = cli("run", str(path), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = cli("status", name, "--json", "--storage", f"sqlite:///{tmp_path}/{name}.db", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)


def _gpu_s(stage: dict[str, Any]) -> float:
    return sum(t["gpu_time_s"] or 0.0 for t in stage["trials"])


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _replay_demo(tmp_path_factory.mktemp("pruned"), "demo")


@pytest.fixture(scope="module")
def unpruned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    def no_pruning(data: dict[str, Any]) -> None:
        for stage in data["stages"]:
            stage["pruner"] = {"name": "none"}

    return _replay_demo(tmp_path_factory.mktemp("unpruned"), "demo", no_pruning)


def test_pruning_keeps_each_stages_winner(pruned: dict[str, Any], unpruned: dict[str, Any]) -> None:
    for a, b in zip(pruned["stages"], unpruned["stages"]):
        wa, wb = a["winner"], b["winner"]
        same = wa["overrides"] == wb["overrides"]
        within = wb["eta_low"] <= wa["eta"] <= wb["eta_high"] or wa["eta_low"] <= wb["eta"] <= wa["eta_high"]
        assert same or within, (a["name"], wa, wb)


@pytest.mark.xfail(strict=True, reason="the goal: pruning saves 30% of a study's GPU-hours; 22.6% SIMULATED today "
                                        "(docs/benchmarks.md, where the cost goes)")
def test_pruning_saves_30_percent_of_the_studys_gpu_hours(pruned: dict[str, Any], unpruned: dict[str, Any]) -> None:
    # The study's whole GPU time, as a user pays it: every trial the policy ran, confirmations
    # and follow-up rounds included. SIMULATED, sampler seed 7: 32% when the mark was set
    # (31.9-34.1% over seeds 1, 2, 3 and 7); 22.6% with settled speed probes, whose stages pruning
    # no longer shortens.
    totals = [sum(_gpu_s(s) for s in study["stages"]) / 3600 for study in (pruned, unpruned)]
    print(f"simulated GPU-hours: {totals[0]:.0f} with pruning, {totals[1]:.0f} without")
    assert 1 - totals[0] / totals[1] >= 0.30


def test_stage_0_finds_a_layout_at_least_as_fast_as_the_template(pruned: dict[str, Any]) -> None:
    from verl_sweep.launchers.simulator import load_landscape
    from verl_sweep.search.spec.study_file import load_study
    from verl_sweep.verl_knowledge import check_config, template_for
    from verl_sweep.verl_knowledge import merge

    spec = load_study(REPO / "studies" / "demo.yaml")
    systems = pruned["stages"][0]
    assert systems["name"] == "systems"
    landscape = load_landscape("default")
    base = systems["incumbent"]["config"]
    template = merge(base, template_for(spec.model, spec.hardware, spec.algorithm).config)
    winner = systems["winner"]["config"]
    # true (noise-free) throughput of the chosen layout vs the source's template
    assert landscape.expected(winner).throughput >= landscape.expected(template).throughput
    probes = [t for t in systems["trials"] if t["state"] != "fail" or t["failure_kind"]]
    # the budget counts every probe but the confirmation re-runs
    assert len([t for t in probes if t["role"] not in ("skipped", "rerun")]) <= spec.stages[0].budget.max_trials
    facts = {"model": spec.model, "hardware": spec.hardware, "algorithm": spec.algorithm}
    for trial in systems["trials"]:
        assert check_config(merge(base, trial["params"]), **facts) == [], trial


def test_short_probe_stages_cost_under_a_quarter(pruned: dict[str, Any]) -> None:
    by_name = {s["name"]: _gpu_s(s) for s in pruned["stages"]}
    share = (by_name["systems"] + by_name["tokens"]) / sum(by_name.values())
    print(f"stage 0 + stage 3 share of simulated GPU time: {share:.1%}")
    # The speed stages are a few probes' worth of the study: their probes end once tokens/s
    # settles (docs/method.md, Evidence).
    assert share < 0.15


def test_every_probe_reports_utilisation_and_diagnosis(pruned: dict[str, Any]) -> None:
    for stage in pruned["stages"]:
        for trial in stage["trials"]:
            if trial["state"] in ("complete", "pruned"):
                assert trial["gpu"]["mean_util_pct"] > 0 and trial["gpu"]["diagnosis"], trial


def test_diverging_candidates_are_stopped_with_a_reason(tmp_path: Path) -> None:
    from verl_sweep.launchers.simulator import load_landscape

    def reckless_lr(data: dict[str, Any]) -> None:
        data["stages"] = [{"name": "lr", "space": "lr", "params": {"high": 2e-4, "unsafe": True},
                           "budget": {"max_trials": 6}, "confirm_top": 0}]

    status = _replay_demo(tmp_path, "reckless", reckless_lr)
    landscape = load_landscape("default")
    stage = status["stages"][0]
    stopped = [t for t in stage["trials"] if t["state"] == "pruned" and t["reason"]
               and t["reason"].split(":")[0] in ("kl_divergence", "non_finite", "grad_explosion")]
    assert stopped, [(t["params"], t["state"], t["reason"]) for t in stage["trials"]]
    for trial in stopped:
        expected = landscape.expected({**stage["incumbent"]["config"], **trial["params"]})
        assert expected.diverges
        assert trial["last_step"] - expected.diverge_step <= 50, trial
    text = cli("status", "reckless", "--storage", f"sqlite:///{tmp_path}/reckless.db", cwd=tmp_path).stdout
    assert stopped[0]["reason"].split(":")[0] in text


def test_incumbent_runs_the_previous_stage_made_are_carried_over_not_rerun(pruned: dict[str, Any]) -> None:
    """Every run the minibatch stage made of the config it chose (its incumbent's, or the
    winner's first run and confirmations) is an incumbent run of the kl stage, not run again;
    those on seeds beyond the incumbent's own two stay out of the kl stage's budget."""
    stages = {s["name"]: s for s in pruned["stages"]}
    chosen = stages["minibatch"]["winner"]
    made = {t["seed"] for t in stages["minibatch"]["trials"]  # every scored run of the chosen config
            if t["state"] == "complete" and t["eta"] is not None and t["params"] == chosen["overrides"]}
    incumbents = [t for t in stages["kl"]["trials"] if t["role"] == "incumbent"]
    carried = [t for t in incumbents if t["carried_from"]]
    assert {t["seed"] for t in carried} == made and len(carried) >= 2
    for row in carried:
        assert row["carried_from"].startswith("demo.minibatch.t") and row["gpu_time_s"] == 0.0
        assert row["state"] == "complete" and row["eta"] is not None
    assert {t["seed"] for t in incumbents} >= {11, 12}  # the incumbent's own seeds, carried or run
    counted = [t for t in stages["kl"]["trials"] if not t["requeued"] and t["role"] != "rerun"
               and not (t["carried_from"] and t["seed"] not in (11, 12))]
    assert len(counted) <= stages["kl"]["budget"]
    # the minibatch stage runs 500-step probes after the 30-step token stage: nothing carried
    assert not any(t["carried_from"] for t in stages["minibatch"]["trials"])


def test_speed_probes_end_once_their_reading_settles(pruned: dict[str, Any]) -> None:
    """A speed probe ends once two scored steps agree (one warm-up step, then usually two to
    four); one whose reading does not settle is stopped in the second half if it is slow."""
    import statistics

    systems = pruned["stages"][0]
    ran = [t for t in systems["trials"] if t["last_step"]]
    assert statistics.median(t["last_step"] for t in ran) <= 5, sorted(t["last_step"] for t in ran)
    stopped = [t for t in ran if t["state"] == "pruned"]
    for t in stopped:
        assert t["role"] == "candidate"
        assert 15 <= t["last_step"] < 30, t
    winner = systems["winner"]
    assert winner is not None and winner["eta"] > max([t["eta"] or 0.0 for t in stopped], default=0.0)
