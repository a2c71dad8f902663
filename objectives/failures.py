"""Why a verl run ended early: classify the end of its stderr and its exit code.

The driver uses the kind to decide what to tell Optuna: an infrastructure failure
(``retryable``) is re-run on the same parameters; an OOM or a config error is a property of
the parameters (infeasible) and is never retried.

Success is judged by the metrics, not the exit code: verl can print "A worker died or was
killed" while shutting down after a good run, and a probe stopped from outside at step N
exits non-zero. A run whose last metrics step reached the expected step count succeeded.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
import signal
from pathlib import Path

from verl_sweep.launchers.run_dir import error_lines, tail

logger = logging.getLogger(__name__)


class FailureKind(enum.Enum):
    OOM = "oom"
    NCCL_TIMEOUT = "nccl_timeout"
    ACTOR_DIED = "actor_died"
    CONFIG_ERROR = "config_error"
    #: vLLM's engine did not start; its root cause stays in the Ray worker's own log, and on
    #: a shared GPU it can be a neighbour freeing memory during vLLM's start-up profiling
    ENGINE_START = "engine_start"
    KILLED = "killed"
    HANG = "hang"
    CRASH = "crash"

    @property
    def retryable(self) -> bool:
        """True for infrastructure failures that a re-run on the same parameters may not hit."""
        return self in _RETRYABLE


_RETRYABLE = frozenset(
    {FailureKind.NCCL_TIMEOUT, FailureKind.ACTOR_DIED, FailureKind.ENGINE_START, FailureKind.KILLED, FailureKind.HANG}
)

# Checked in this order: an OOM usually also kills an actor, and a config error can mention
# anything, so the most specific cause wins. Texts marked "real verl" are what verl 0.9.1 +
# vLLM 0.24.0 print (the recorded texts are in tests/data/real-verl-0.9.1/).
_SIGNATURES: tuple[tuple[FailureKind, re.Pattern[str]], ...] = (
    (
        FailureKind.OOM,
        re.compile(
            r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|CUDA Error: out of memory"
            r"|HIP out of memory|No available memory for the cache blocks"
            r"|less than desired GPU memory utilization"  # vLLM's start-up check of the memory fraction
            r"|Insufficient memory|RESOURCE_EXHAUSTED.*memory",
            re.IGNORECASE,
        ),
    ),
    (
        FailureKind.NCCL_TIMEOUT,
        re.compile(
            r"Watchdog caught collective operation timeout|NCCL (?:communicator|operation).*tim(?:ed)? ?out"
            r"|ProcessGroupNCCL.*[Tt]imeout|DistBackendError.*[Tt]imeout|NCCL timeout",
        ),
    ),
    (
        FailureKind.ENGINE_START,
        re.compile(
            r"Error in memory profiling"  # vllm/v1/worker/gpu_worker.py: another process freed memory
            r"|^RuntimeError: Engine core initialization failed.*"  # real verl: often all the stderr says
            r"|WorkerProc initialization failed",
            re.MULTILINE,
        ),
    ),
    (
        FailureKind.CONFIG_ERROR,
        re.compile(
            r"Could not override|ConfigCompositionException"
            r"|ConfigAttributeError|ConfigKeyError|omegaconf\.errors|Key '[^']+' is not in struct"
            r"|MissingMandatoryValue|InterpolationResolutionError|hydra\.errors"
            # real verl: verl's start-up and first-step checks are assertions on the config, e.g.
            # "rollout world_size: 1 is not divisible by infer_world_size: 2" (TP 2 on 1 GPU)
            r"|^AssertionError: .*"
            r"|Error executing job with overrides",  # Hydra's wrapper of any failure: the weakest sign
            re.MULTILINE,
        ),
    ),
    (
        FailureKind.ACTOR_DIED,
        re.compile(
            r"ActorDiedError|A worker died or was killed|RayActorError|The actor died"
            r"|WorkerCrashedError|NodeDiedError|ActorUnavailableError|raylet.*died",
        ),
    ),
    (
        FailureKind.KILLED,
        re.compile(r"^Killed$|received SIGTERM|received signal SIGKILL|Terminated$", re.MULTILINE),
    ),
)

#: what Ray and vLLM put before a forwarded line: colour codes, ``(TaskRunnerV1 pid=17756)``,
#: ``(EngineCore pid=20304)``, vLLM's ``ERROR 12-01 18:41:08 [multiproc_executor.py:898]``,
#: and the local launcher's ``(worker-<id>.err)`` / ``.out`` naming the Ray worker log a line came from
_LINE_PREFIX = re.compile(
    r"^(?:\x1b\[[0-9;]*m\s*|\((?:[\w.]+ )?pid=\d+[^)]*\)\s*|\([\w.-]+\.(?:err|out)\)\s*"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\]\s*)+",
    re.MULTILINE,
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _plain(text: str) -> str:
    """The text with Ray's and vLLM's per-line prefixes and colour codes removed."""
    return _ANSI.sub("", _LINE_PREFIX.sub("", text))


# Exit codes of a process ended by a signal: negative (Python's subprocess) or 128 + signo.
_KILL_SIGNALS = {int(signal.SIGKILL), int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}


@dataclasses.dataclass(frozen=True)
class Failure:
    """A classified failure with the line that gave it away (or why none did)."""

    kind: FailureKind
    evidence: str


def diagnose(
    stderr_tail: str, exit_code: int | None, *, last_step: int, expected_steps: int
) -> Failure | None:
    """Like ``classify`` but also returns the evidence (the matching line or the exit code)."""
    if expected_steps > 0 and last_step >= expected_steps:
        return None
    stderr_tail = _plain(stderr_tail)
    for kind, pattern in _SIGNATURES:
        match = pattern.search(stderr_tail)
        if match:
            evidence = _line_at(stderr_tail, match.start())
            if evidence.startswith(_HYDRA_WRAPPER):
                evidence = _cause_after(stderr_tail, match.end()) or evidence
            return Failure(kind, evidence)
    if exit_code is None:
        # Not exited by itself: the caller stopped it because its metrics stopped coming.
        return Failure(FailureKind.HANG, f"no exit code; last metrics step {last_step} of {expected_steps}")
    if (exit_code < 0 and -exit_code in _KILL_SIGNALS) or (exit_code - 128) in _KILL_SIGNALS:
        signo = -exit_code if exit_code < 0 else exit_code - 128
        return Failure(FailureKind.KILLED, f"exit code {exit_code} (signal {signal.Signals(signo).name})")
    if exit_code == 0:
        return Failure(
            FailureKind.CRASH, f"exit code 0 at step {last_step} of {expected_steps} (ended early: data or epochs?)"
        )
    found = _EXCEPTION_LINE.findall(stderr_tail)
    lines = [line for line in stderr_tail.splitlines() if line.strip() and not line.startswith(_HYDRA_FOOTER)]
    evidence = found[-1] if found else (lines[-1] if lines else f"exit code {exit_code}")
    return Failure(FailureKind.CRASH, evidence.strip()[:300])


def classify(
    stderr_tail: str, exit_code: int | None, *, last_step: int, expected_steps: int
) -> FailureKind | None:
    """The failure kind, or None when the run succeeded (its metrics reached ``expected_steps``).

    ``exit_code`` None means the process did not exit by itself (it was stopped from outside
    after no progress), which is a HANG unless stderr names another cause.
    """
    failure = diagnose(stderr_tail, exit_code, last_step=last_step, expected_steps=expected_steps)
    return None if failure is None else failure.kind


#: Hydra's first line of any failed job: it lists the overrides; the cause comes after it
_HYDRA_WRAPPER = "Error executing job with overrides"
#: Hydra's last line of any failed job: never the evidence
_HYDRA_FOOTER = "Set the environment variable HYDRA_FULL_ERROR"
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception)|Could not override|Key '[^']+' is not in struct)\b.*", re.MULTILINE)


def _cause_after(text: str, index: int) -> str | None:
    """The last exception line after Hydra's wrapper line (the one that names the cause)."""
    found = _EXCEPTION_LINE.findall(text, index)
    return found[-1].strip()[:300] if found else None


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)].strip()[:300]


def failure_text(*, stderr: Path, stdout: Path, worker_errors: Path) -> str:
    """What a failed run left to diagnose it by: the error lines its private Ray session's
    workers logged (kept by the local launcher), then the error lines Ray forwarded to the
    run's stdout (vLLM's engine workers log their exception there and nowhere else, e.g. "less
    than desired GPU memory utilization"), then the end of its stderr."""
    forwarded = "\n".join(error_lines(tail(stdout, n_lines=400).splitlines())[-40:])
    return "\n".join(filter(None, (tail(worker_errors, n_lines=60), forwarded, tail(stderr, n_lines=40))))
