"""Studies stored by release 0de9162 (``tests/data/release-0de9162``: decisions stored as
sentences, wasted trials named in their reason) read through the one compatibility reader
(``verl_sweep.search.database.compat``): every stage decision comes back as data, and a resume, ``status`` and
the stages that read earlier decisions behave on them as that release did."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support import REPO

from benchmarks import methods as M
from verl_sweep.search.database import compat
from verl_sweep.search.views.console import Console
from verl_sweep.search.engine.driver import StudyRunner
from verl_sweep.search.database.records import CloseReason, Decision, records
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.engine.stage_loop import Context, slow_start_seen, undecided_leaders
from verl_sweep.search.views.status import finished_results, study_status
from verl_sweep.search.database.storage import open_storage
from verl_sweep.search.database.study_root import load_spec, stored_stage_result
from verl_sweep.spaces import build_space

pytestmark = pytest.mark.fast

RELEASE_DB = REPO / "tests" / "data" / "release-0de9162" / "studies.db"

#: what release 0de9162 decided in each stage of the database, and how its sentence began
STORED = {
    ("flat", "slow"): (Decision.KEPT, "kept the incumbent: no candidate finished"),
    ("flat", "kl"): (Decision.SKIPPED, "skipped: the first 1 stages kept the baseline"),
    ("flat", "lr"): (Decision.SKIPPED, "skipped: the first 1 stages kept the baseline"),
    ("slow", "minibatch"): (Decision.SLOW_START, "slow start: kept the incumbent"),
    ("slow", "lr"): (Decision.KEPT, "kept the incumbent: best η"),
    ("chain", "tokens"): (Decision.WON, "trial 3 beat the incumbent: η"),
    ("chain", "minibatch"): (Decision.WON, "trial 5 beat the incumbent: η"),
    ("chain", "lr"): (Decision.KEPT, "kept the incumbent: best η"),
    ("noisy", "minibatch"): (Decision.WON_ON_BALANCE, "trial 3 beat the incumbent on balance: η"),
    ("noisy", "lr"): (Decision.UNDECIDED, "no significant gain: trial 5 has η"),
}


@pytest.fixture
def storage(tmp_path: Path) -> object:
    db = tmp_path / "studies.db"
    shutil.copy(RELEASE_DB, db)
    return open_storage(f"sqlite:///{db}", create=False)


def test_every_stored_decision_is_read_as_data(storage: object) -> None:
    for (study, stage_name), (decision, sentence) in STORED.items():
        spec = load_spec(storage, study)
        stage = next(s for s in spec.stages if s.name == stage_name)
        result = stored_stage_result(storage, spec, stage)
        assert result is not None and result.decision is decision, (study, stage_name, result)
        assert result.summary.startswith(sentence)  # the sentence is kept, to be shown
        assert (result.winner_trial is not None) is (decision in (Decision.WON, Decision.WON_ON_BALANCE))


def test_trials_closed_as_wasted_by_the_release_read_as_such(storage: object) -> None:
    import optuna

    lost = next(n for n in optuna.get_all_study_names(storage) if "~lost" in n)
    trials = records(optuna.load_study(study_name=lost, storage=storage).get_trials(deepcopy=False))
    assert trials and all(t.closed_as is CloseReason.WASTED for t in trials)
    assert {t.reason for t in trials} == {"ran ahead from a leader of minibatch that did not win"}


def test_the_stages_that_read_earlier_decisions_read_the_stored_ones(storage: object) -> None:
    noisy, slow = load_spec(storage, "noisy"), load_spec(storage, "slow")
    ctx = Context(noisy, storage, None, Console(quiet=True), build_space)  # type: ignore[arg-type]
    # noisy's lr stage kept its incumbent with an undecided leader: a later polish would try it
    leaders = undecided_leaders(ctx, 2)
    assert [name for name, _ in leaders] == ["lr"]
    assert slow_start_seen(Context(slow, storage, None, Console(quiet=True), build_space), 1)  # type: ignore[arg-type]
    # its lr stage ran 4x longer probes, and status reads the stretched stage from its study
    assert Stage.stored(slow, 1, 2000).probe_steps == 2000 == 4 * slow.probe.steps


def test_a_resume_of_a_study_stopped_flat_runs_nothing(storage: object, tmp_path: Path) -> None:
    spec = load_spec(storage, "flat")
    launcher = M.replay_launcher(tmp_path / "runs", "default")
    config = StudyRunner(spec, storage, launcher, console=Console(quiet=True), build_space=build_space).run()
    assert launcher.usage() == [] and config == spec.baseline_config()


def test_status_shows_the_release_s_sentences(storage: object) -> None:
    spec = load_spec(storage, "chain")
    status = study_status(storage, spec)
    winners = {s["name"]: s["winner"] for s in status["stages"]}
    assert winners["minibatch"]["decision"] == "won"
    assert winners["minibatch"]["summary"].startswith("trial 5 beat the incumbent: η")
    assert [r.decision for r in finished_results(storage, spec)] == [Decision.WON, Decision.WON, Decision.KEPT]


@pytest.mark.parametrize(("sentence", "winner", "decision"), [
    ("kept the incumbent: no candidate beat it by more than 2%", None, "kept"),
    ("kept the incumbent: no candidate held up on a fresh seed", None, "kept"),
    ("slow start: kept the incumbent, whose reward still rose fastest", None, "slow start"),
    ("skipped: the first 3 stages kept the baseline", None, "skipped"),
    ("no significant gain: best trial 4 has η 1.031", None, "undecided"),
    ("trial 4 beat the incumbent (η 1.100)", 4, "won"),
    ("trial 4 beat the incumbent on balance: η 1.047 [0.992, 1.105] over 5 runs", 4, "won on balance"),
])
def test_every_sentence_the_releases_stored(sentence: str, winner: int | None, decision: str) -> None:
    assert compat.decision_of(sentence, winner_trial=winner) == decision
