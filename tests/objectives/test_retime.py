"""Re-timing a run to another layout: each phase of a step by its own ratio, read off paired
speed probes of the two layouts (``verl_sweep.objectives.retime``)."""

from __future__ import annotations

import pytest

from verl_sweep.objectives.metrics import STEP_TIME_KEY, StepMetrics
from verl_sweep.objectives.retime import REST, PhaseRatios, retimed

pytestmark = pytest.mark.fast

#: seconds a unit of work takes at each layout, by phase: the slow layout generates 1.5 times
#: and updates 3 times slower; the rest of the step does not depend on the layout
SLOW = {"timing_s/gen": 1.5, "timing_s/old_log_prob": 2.0, "timing_s/update_actor": 3.0}
FAST = {"timing_s/gen": 1.0, "timing_s/old_log_prob": 1.0, "timing_s/update_actor": 1.0}
OTHER_S = 10.0


def step(number: int, per_unit: dict[str, float], response: float, noise: float = 1.0) -> StepMetrics:
    """A step whose generation grows with the response length and whose passes with the whole
    sequence (prompt 100 tokens), every phase scaled by the step's ``noise``."""
    work = {"timing_s/gen": response, "timing_s/old_log_prob": 100 + response, "timing_s/update_actor": 100 + response}
    phases = {k: per_unit[k] * work[k] / 10 * noise for k in work}
    return StepMetrics(number, {**phases, STEP_TIME_KEY: sum(phases.values()) + OTHER_S, "critic/score/mean": 0.1})


def probes(per_unit: dict[str, float]) -> dict[tuple[int, int], StepMetrics]:
    """Speed probes on seeds 1 and 2, steps 2-4, short responses; a seed's noise on both layouts."""
    return {(seed, n): step(n, per_unit, 200, noise=1 + 0.05 * seed - 0.02 * n) for seed in (1, 2) for n in (2, 3, 4)}


def test_each_phase_gets_its_ratio_and_a_long_run_is_retimed_as_the_slow_layout_runs_it() -> None:
    ratios = PhaseRatios.of(probes(SLOW), probes(FAST))
    assert ratios is not None and ratios.pairs == 6
    for phase, seconds in SLOW.items():
        assert ratios.ratios[phase] == pytest.approx(seconds / FAST[phase])
    assert ratios.ratios[REST] == pytest.approx(1.0)
    # A learning run at the fast layout whose responses grow from 200 to 800 tokens: re-timed,
    # each step takes what the slow layout takes at that length.
    run = [step(n, FAST, 200 + 600 * n / 100) for n in range(1, 101)]
    slow = [step(n, SLOW, 200 + 600 * n / 100) for n in range(1, 101)]
    for got, want in zip(retimed(run, ratios), slow):
        assert got.get(STEP_TIME_KEY) == pytest.approx(want.get(STEP_TIME_KEY))
        assert got.get("critic/score/mean") == 0.1  # what the step learned is the same
    # One ratio for the whole step (the probes' step-time ratio) misreads the long run: its mix
    # of phases moved towards the passes, which the slow layout slows most.
    whole = sum(s.get(STEP_TIME_KEY) or 0 for s in slow) / sum(s.get(STEP_TIME_KEY) or 0 for s in run)
    assert ratios.step < whole * 0.99


def test_no_shared_seed_and_step_gives_no_ratios() -> None:
    slow = {(1, n): s for (seed, n), s in probes(SLOW).items() if seed == 1}
    fast = {(2, n): s for (seed, n), s in probes(FAST).items() if seed == 2}
    assert PhaseRatios.of(slow, fast) is None
    no_time = {key: StepMetrics(s.step, {k: v for k, v in s.data.items() if k != STEP_TIME_KEY})
               for key, s in probes(FAST).items()}
    assert PhaseRatios.of(probes(SLOW), no_time) is None


def test_a_run_without_phase_timings_is_retimed_by_the_whole_steps_ratio() -> None:
    """verl logs ``timing_s/*`` phases; a run that logged only its step time (another logger,
    an older verl) is slowed by the probes' step ratio, and a phase the probes never saw too."""
    ratios = PhaseRatios.of(probes(SLOW), probes(FAST))
    assert ratios is not None
    bare = [StepMetrics(1, {STEP_TIME_KEY: 10.0}), StepMetrics(2, {STEP_TIME_KEY: 10.0, "timing_s/ref": 4.0})]
    out = retimed(bare, ratios)
    assert out[0].get(STEP_TIME_KEY) == pytest.approx(10.0 * ratios.ratios[REST])
    assert out[1].get(STEP_TIME_KEY) == pytest.approx(6.0 * ratios.ratios[REST] + 4.0 * ratios.step)
    assert PhaseRatios.from_attr(ratios.to_attr()) == ratios


def test_a_rest_within_the_phases_noise_takes_the_whole_steps_ratio() -> None:
    """The rest of a step is its time less the phases': where it is a sliver (here -0.5%
    against +1%), its ratio would be noise over noise."""
    def with_rest(per_unit: dict[str, float], rest: float) -> dict[tuple[int, int], StepMetrics]:
        out = {}
        for key, s in probes(per_unit).items():
            phases = sum(v for k, v in s.data.items() if k.startswith("timing_s/") and k != STEP_TIME_KEY)
            out[key] = StepMetrics(s.step, {**s.data, STEP_TIME_KEY: phases * (1 + rest)})
        return out

    ratios = PhaseRatios.of(with_rest(SLOW, 0.01), with_rest(FAST, -0.005))
    assert ratios is not None and ratios.ratios[REST] == pytest.approx(ratios.step)


def test_the_ratios_uncertainty_widens_a_gain_read_against_retimed_runs() -> None:
    """Probes whose steps share their noise (one seed, both layouts: the simulator's) give a
    ratio with next to no spread, and leave a gain's interval as it was; probes whose steps jitter
    apart (real hosts) widen it by the spread's standard error, its value unchanged."""
    from verl_sweep.objectives.score import Eta

    gain = Eta(2.0, 1.9, 2.1)
    shared = PhaseRatios.of(probes(SLOW), probes(FAST))
    assert shared is not None and shared.log_se < 0.001  # (the rest of a step takes no noise here)
    assert shared.widen(gain).low == pytest.approx(gain.low, rel=1e-3)
    jitter = {key: step(key[1], SLOW, 200, noise=1 + 0.08 * (-1) ** (key[0] + key[1])) for key in probes(SLOW)}
    apart = PhaseRatios.of(jitter, probes(FAST))
    assert apart is not None and apart.log_se > 0.02
    wide = apart.widen(gain)
    assert wide.value == gain.value and wide.low < gain.low and wide.high > gain.high
    one_pair = {(1, 2): probes(SLOW)[(1, 2)]}
    assert PhaseRatios.of(one_pair, probes(FAST)) is None  # one pair cannot tell its own spread
