"""Failure classification on real-looking stderr tails, and the log tail helper."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_sweep.objectives.failures import FailureKind, classify, diagnose, tail

pytestmark = pytest.mark.fast

OOM = """Traceback (most recent call last):
  File "/verl/workers/fsdp_workers.py", line 812, in update_actor
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.15 GiB
ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."""
NCCL = """[rank3]:[E ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1200, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600042 milliseconds before timing out."""
ACTOR = """ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
A worker died or was killed while executing a task by an unexpected system error."""
CONFIG = """Error executing job with overrides: ['actor_rollout_ref.actor.ppo_mini_batch_sise=256']
Could not override 'actor_rollout_ref.actor.ppo_mini_batch_sise'.
Key 'ppo_mini_batch_sise' is not in struct"""


@pytest.mark.parametrize(
    ("stderr", "code", "expected"),
    [
        (OOM, 1, FailureKind.OOM),  # OOM wins over the actor death it caused
        (NCCL, 1, FailureKind.NCCL_TIMEOUT),
        (ACTOR, 1, FailureKind.ACTOR_DIED),
        (CONFIG, 1, FailureKind.CONFIG_ERROR),
        ("", -9, FailureKind.KILLED),
        ("", 137, FailureKind.KILLED),
        ("", -15, FailureKind.KILLED),
        ("some noise\nKilled\n", 1, FailureKind.KILLED),
        ("", None, FailureKind.HANG),
        ("ValueError: something broke", 1, FailureKind.CRASH),
        ("", 0, FailureKind.CRASH),  # exited 0 but far short of the expected steps
        ("CUDA Error: out of memory (vLLM wake_up)", 1, FailureKind.OOM),
    ],
)
def test_classify_signatures(stderr: str, code: int | None, expected: FailureKind) -> None:
    assert classify(stderr, code, last_step=12, expected_steps=500) is expected


def test_worker_died_after_a_good_run_is_success() -> None:
    assert classify(ACTOR, 1, last_step=500, expected_steps=500) is None
    assert classify(ACTOR, 1, last_step=499, expected_steps=500) is FailureKind.ACTOR_DIED


def test_retryable() -> None:
    retry = {k for k in FailureKind if k.retryable}
    assert retry == {FailureKind.NCCL_TIMEOUT, FailureKind.ACTOR_DIED, FailureKind.ENGINE_START, FailureKind.KILLED,
                     FailureKind.HANG}
    assert not FailureKind.OOM.retryable and not FailureKind.CONFIG_ERROR.retryable


def test_diagnose_names_the_evidence_line() -> None:
    failure = diagnose(OOM, 1, last_step=3, expected_steps=500)
    assert failure is not None and failure.evidence.startswith("torch.OutOfMemoryError")


def test_a_hydra_failure_names_its_cause_not_the_override_list() -> None:
    # Hydra's first line lists every override (hundreds of characters); the cause comes last.
    failure = diagnose(CONFIG, 1, last_step=0, expected_steps=500)
    assert failure is not None and failure.evidence == "Key 'ppo_mini_batch_sise' is not in struct"
    sim = ("Error executing job with overrides: ['a=1', 'b=2']\n"
           "LandscapeError: landscape must be a file or one of ['default'], but got 'defualt'.\n")
    failure = diagnose(sim, 1, last_step=0, expected_steps=500)
    assert failure is not None and failure.evidence.startswith("LandscapeError: landscape must be")
    bare = diagnose("Error executing job with overrides: ['a=1']\n", 1, last_step=0, expected_steps=500)
    assert bare is not None and bare.evidence.startswith("Error executing job")


def test_tail_reads_only_the_end(tmp_path: Path) -> None:
    path = tmp_path / "stderr.log"
    assert tail(path) == ""
    lines = [f"line {i} " + "x" * 200 for i in range(5000)]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe bad bytes\n")
    got = tail(path, n_lines=3).splitlines()
    assert got[:2] == lines[-2:]
    assert got[2].endswith("bad bytes")
    assert len(tail(path, n_lines=20).splitlines()) == 20
    with pytest.raises(ValueError, match="n_lines must be >= 1, but got 0"):
        tail(path, n_lines=0)


@pytest.mark.parametrize(
    "line",
    [
        "\x1b[36m(vLLMHttpServer pid=12952)\x1b[0m (Worker pid=14399) ERROR 12-01 18:41:08 [multiproc_executor.py:898] "
        "ValueError: Free memory on device cuda:0 (102.1/139.8 GiB) on startup is less than desired GPU memory "
        "utilization (1.0, 139.8 GiB).",
        "(worker-2f2bb83c-01000000-10451.out) (EngineCore pid=12445) ValueError: Free memory on device cuda:0 "
        "(102.1/139.8 GiB) on startup is less than desired GPU memory utilization (1.0, 139.8 GiB).",
    ],
)
def test_evidence_is_the_line_without_what_ray_vllm_and_the_launcher_put_before_it(line: str) -> None:
    failure = diagnose(line, 1, last_step=0, expected_steps=10)
    assert failure is not None and failure.kind is FailureKind.OOM
    assert failure.evidence.startswith("ValueError: Free memory on device cuda:0")
