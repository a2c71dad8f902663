"""How long the user's run is, and probe lengths that fit inside it.

verl stops at whichever comes first: ``trainer.total_training_steps`` or ``total_epochs`` ×
the steps of an epoch (the train files' rows ÷ ``data.train_batch_size``, the last partial
batch dropped: 7,473 prompts at 1,024 are 7 steps an epoch, 105 in 15 epochs). The rows come
from the local train parquet files' metadata (nothing is read but their footers).

A probe is a short look at the run's start, to be compared with other short looks: a
learning probe may take at most ¼ of the run (``MAX_PROBE_FRACTION``), as the method's
500-step probes are ¼ of its 2,000-step runs (docs/method.md §1: the reward plateau it fights
comes after 2,000 steps), and a longer probe after a slow start at most ½ of it. A probe as
long as the run is no probe: every one would end with the run, "finished", and none could
be told apart from the whole run.

A run too short for learning probes may still take speed probes (throughput needs a few
steps, no trend): the study then tunes speed alone (``ProbeFit.learns`` False).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.verl_knowledge import get

#: the longest learning probe, as a fraction of the run
MAX_PROBE_FRACTION = 0.25
#: the longest probe after a slow start (probe.steps × slow_start_factor), as a fraction
MAX_SLOW_START_FRACTION = 0.5
#: the longest speed probe, as a fraction of the run: one at least as long as a learning
#: probe's ¼ where the run is too short for any (a speed probe must still be a part of the run)
MAX_SPEED_FRACTION = 0.5
VERL_TOTAL_EPOCHS = 30  # verl 0.9.1's trainer.total_epochs
#: a full run's length where neither --run-steps nor the baseline gives one: the method's
#: runs (docs/method.md §1), for the cost in R (one full run of the baseline)
ASSUMED_RUN_STEPS = 2000


@dataclasses.dataclass(frozen=True)
class RunLength:
    """The run's steps (None: unknown) and how they were found, in words."""

    steps: int | None
    how: str
    assumed: bool = False  # ``ASSUMED_RUN_STEPS``, the run's own length being unknown


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):  # a list written as one string
            return [part.strip().strip("'\"") for part in text[1:-1].split(",") if part.strip()]
        return [text]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return []


def parquet_rows(paths: list[str]) -> tuple[int | None, str]:
    """The rows of local parquet files (their metadata only), or (None, why not)."""
    total = 0
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.is_file():
            return None, f"{raw} is not a local file"
        try:
            import pyarrow.parquet as pq

            total += int(pq.ParquetFile(path).metadata.num_rows)
        except Exception as e:  # not parquet, or pyarrow missing
            return None, f"{raw} cannot be read as parquet ({type(e).__name__})"
    return total, ""


def run_length(config: Mapping[str, Any]) -> RunLength:
    """The run's length from its config (trainer.total_training_steps, else epochs × the
    local train files' rows ÷ batch)."""
    total = get(config, "trainer.total_training_steps")
    epochs = get(config, "trainer.total_epochs", VERL_TOTAL_EPOCHS)
    batch = get(config, "data.train_batch_size", 1024)
    files = _as_list(get(config, "data.train_files"))
    rows, why = parquet_rows(files) if files else (None, "data.train_files is not set")
    by_epochs = None
    if rows is not None and isinstance(batch, int) and batch > 0 and isinstance(epochs, int) and epochs > 0:
        by_epochs = epochs * (rows // batch)
    if isinstance(total, int) and not isinstance(total, bool) and total > 0:
        if by_epochs is not None and by_epochs < total:
            return RunLength(by_epochs, f"{epochs} epochs × ({rows:,} prompts ÷ batch {batch} = {rows // batch} steps) = "
                                        f"{by_epochs:,} steps, before trainer.total_training_steps {total:,}")
        return RunLength(total, f"trainer.total_training_steps = {total:,}")
    if by_epochs is not None:
        return RunLength(by_epochs, f"{epochs} epochs × ({rows:,} prompts ÷ batch {batch} = {rows // batch} steps) "
                                    f"= {by_epochs:,} steps")
    return RunLength(None, f"unknown: no trainer.total_training_steps, and {why}")


def full_run_length(config: Mapping[str, Any], run_steps: int | None = None) -> RunLength:
    """A full run's length, for the cost in R (one full run of the baseline): ``run_steps``
    (``--run-steps``) if given, else the run's own (``run_length``), else ``ASSUMED_RUN_STEPS``."""
    if run_steps is not None:
        return RunLength(run_steps, "--run-steps")
    known = run_length(config)
    if known.steps is not None:
        return known
    return RunLength(ASSUMED_RUN_STEPS, f"{ASSUMED_RUN_STEPS:,} steps assumed", assumed=True)


def probe_horizon(run_steps: int | None, probe_steps: int) -> int | None:
    """The step a learning probe's rate is read to: the run's end, but at most 1 ÷
    ``MAX_PROBE_FRACTION`` (4×) the probe's length (the method's probes are ¼ of its runs: read
    further, the rate is mostly the fitted curve's guess at a ceiling the probe never neared)."""
    if run_steps is None:
        return None
    return max(probe_steps, min(run_steps, math.ceil(probe_steps / MAX_PROBE_FRACTION)))


def study_run_length(spec: Any, run_steps: int | None = None) -> RunLength:
    """The full run a study tunes for: ``run_steps`` (``--run-steps``), else the study file's
    ``run_steps``, else the baseline's (``full_run_length``)."""
    if run_steps is None and spec.run_steps is not None:
        return RunLength(spec.run_steps, "the study's run_steps")
    return full_run_length(spec.baseline_config(), run_steps)


@dataclasses.dataclass(frozen=True)
class ProbeFit:
    """Probe lengths that fit a run: learning ``steps``, ``speed_steps``, ``slow_start_factor``,
    whether learning probes fit at all (``learns``: False leaves the study its speed stages),
    and the sentence saying what was changed and why (empty when nothing was)."""

    steps: int
    speed_steps: int
    slow_start_factor: int
    note: str
    learns: bool = True


def min_run_steps(min_steps: int, fraction: float) -> int:
    """The shortest run that holds a probe of ``min_steps`` in ``fraction`` of it."""
    return math.ceil(min_steps / fraction)


def fit_probes(run: RunLength, *, steps: int, speed_steps: int, slow_start_factor: int,
               min_steps: int, min_speed_steps: int) -> ProbeFit | str:
    """Probes no longer than ¼ of the run (a slow start's at most ½). A run too short for
    learning probes of ``min_steps`` gets speed probes alone (at most ½ of it); one too short
    even for those gets the one line that says what to set."""
    if run.steps is None:
        return ProbeFit(steps, speed_steps, slow_start_factor, "")
    cap = math.floor(run.steps * MAX_PROBE_FRACTION)
    new_speed = max(min_speed_steps, min(speed_steps, cap))
    need = min_run_steps(min_steps, MAX_PROBE_FRACTION)
    if cap < min_steps:
        if new_speed > run.steps * MAX_SPEED_FRACTION:
            speed_need = min_run_steps(min_speed_steps, MAX_SPEED_FRACTION)
            return (f"the run must be at least {speed_need} steps for speed probes of {min_speed_steps} steps (½ of the "
                    f"run at most), but it is {run.steps} ({run.how}). Set trainer.total_training_steps ≥ {need} for "
                    f"every stage (≥ {speed_need} for the speed stages alone), or more trainer.total_epochs.")
        note = (f"the run is {run.steps:,} steps ({run.how}), too short for learning probes (≥ {need} steps needed: "
                f"{min_steps} scored steps in ¼ of the run)")
        return ProbeFit(steps, new_speed, slow_start_factor, note, learns=False)
    new_steps = min(steps, cap)
    factor = max(1, min(slow_start_factor, math.floor(run.steps * MAX_SLOW_START_FRACTION / new_steps)))
    changed = []
    if new_steps < steps:
        changed.append(f"learning probes {steps} → {new_steps} steps (¼ of the run)")
    if new_speed < speed_steps:
        changed.append(f"speed probes {speed_steps} → {new_speed} steps")
    if factor < slow_start_factor:
        changed.append(f"slow-start factor {slow_start_factor} → {factor} (a longer probe stays ≤ ½ of the run)")
    note = f"the run is {run.steps:,} steps ({run.how}): " + ", ".join(changed) if changed else ""
    return ProbeFit(new_steps, new_speed, factor, note)


def run_steps_of(spec: Any) -> int:
    """The run's length, which train mode trains to; refused when unknown."""
    length = study_run_length(spec)
    if length.steps is None or length.assumed:
        raise BadInputError("train mode trains to the run's end, but the run's length is unknown: set run_steps in the "
                            "study file (or trainer.total_training_steps in the baseline)")
    return length.steps
