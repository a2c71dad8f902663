"""The console's lines, one at a time: a finished trial in at most 120 characters (short names of
what differs from the incumbent, a reason cut at a word), a failed probe's log named but never
echoed, the study's progress counted on after a resume; a pinned override warned once; exported
numbers rounded; one driver per SQLite file."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from verl_sweep.search.views.console import WIDTH, Console, changed_params, cut, short_name
from verl_sweep.search.views.progress import StageCount, StudyProgress

pytestmark = pytest.mark.fast

SYSTEMS = {  # a systems trial: 18 keys, as the demo's winner changes them
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 4,
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096,
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.model.enable_activation_offload": False,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True,
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.rollout.free_cache_engine": True,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.8392458959961938,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True,
    "actor_rollout_ref.rollout.max_num_seqs": 256,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
}
BASE = {"actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 512}
OOM = ("oom: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 19.32 GiB. GPU 0 has a total capacity of "
       "79.20 GiB of which 312.19 MiB is free. Including non-PyTorch memory, this process has 78.40 GiB memory in use.")


def _study(name: str = "demo.systems") -> optuna.Study:
    study = optuna.create_study(direction="maximize", study_name=name)
    study.tell(study.ask(), 1.3)
    return study


def test_short_names_come_from_the_last_name_and_stay_unique() -> None:
    keys = list(SYSTEMS) + ["actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.optim.lr",
                            "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.rollout.max_num_batched_tokens"]
    names = {key: short_name(key, keys) for key in keys}
    assert len(set(names.values())) == len(keys), names
    assert names["actor_rollout_ref.actor.ppo_mini_batch_size"] == "mini_batch"
    assert names["actor_rollout_ref.actor.optim.lr"] == "lr"
    assert names["actor_rollout_ref.actor.kl_loss_coef"] == "kl"
    assert names["actor_rollout_ref.rollout.max_num_batched_tokens"] == "tokens"
    assert names["actor_rollout_ref.rollout.gpu_memory_utilization"] == "mem"
    assert names["actor_rollout_ref.actor.strategy"] == "layout"
    # the actor's and the reference model's: told apart by the name before
    assert names["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] == "actor.sp"
    assert names["actor_rollout_ref.ref.ulysses_sequence_parallel_size"] == "ref.sp"
    assert short_name("actor_rollout_ref.actor.ppo_mini_batch_size") == "mini_batch"


def test_a_finished_trial_is_one_line_of_at_most_120_characters() -> None:
    out = io.StringIO()
    console = Console(out, live=False)
    console.stage_started(0, _Stage("systems"), BASE, [], 80)
    console.trial_finished(_study(), 2, "candidate", SYSTEMS, eta=1.297, interval=(1.283, 1.310))
    line = out.getvalue().splitlines()[-1]
    assert len(line) <= WIDTH, line
    assert line.startswith("[systems] trial 2 candidate η 1.297 [1.283, 1.310]  ")
    # what the incumbent sets comes first (mem changed; tp=2 is the incumbent's and left out)
    assert "  mem=0.839 " in line and "tp=" not in line
    assert line.endswith("more") or line.endswith("best so far"), line
    assert "actor_rollout_ref" not in line


def test_only_what_differs_from_the_incumbent_is_shown() -> None:
    overrides = {"actor_rollout_ref.actor.ppo_mini_batch_size": 512, "actor_rollout_ref.actor.optim.lr": 3.1622776e-06}
    assert changed_params(overrides, BASE, width=100) == "lr=3.16e-06"
    assert changed_params({"actor_rollout_ref.actor.ppo_mini_batch_size": 512}, BASE, width=100) == "= incumbent"
    text = changed_params(SYSTEMS, BASE, width=40)
    assert len(text) <= 40 and text.endswith("more"), text


def test_a_reason_is_cut_at_a_word_never_inside_one() -> None:
    text = cut(OOM, 90)
    assert len(text) <= 90 and text.endswith("…")
    assert OOM.startswith(text[:-1])
    assert OOM[len(text) - 1] in " .,", text  # the word before the ellipsis ended there
    out = io.StringIO()
    Console(out, live=False).trial_finished(_study(), 17, "candidate", SYSTEMS, state="failed", reason=OOM,
                                            stderr_tail="Traceback (most recent call last):\n" + OOM,
                                            log_path="/tmp/runs/demo/demo.systems.t0017/stderr.log")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[systems] trial 17 candidate failed: oom: torch.OutOfMemoryError: CUDA out of memory.")
    assert len(lines[0]) <= WIDTH and " m…" not in lines[0] and not lines[0].endswith(" m.")
    # the probe's output stays in its log: named, never echoed
    assert lines[1:] == ["    log: /tmp/runs/demo/demo.systems.t0017/stderr.log"]


def test_the_study_progress_line_counts_on_after_a_resume() -> None:
    stages = {"systems": StageCount(80, done=82 - 5, reruns=2, gpu_s=3600.0 * 120), "tokens": StageCount(10)}
    progress = StudyProgress("demo", stages, simulated=True)
    out = io.StringIO()
    console = Console(out, live=False, progress=progress)
    console.stage_started(0, _Stage("systems"), BASE, [], 80)
    text = out.getvalue().splitlines()[-1]
    assert text == "study demo: stage 1/2 systems · probes 79/92 · GPU-h 120.0 of ~140 (estimate) SIMULATED", text
    assert console._done == 77  # the stage bar starts where the stage is, not at 0/80
    console.trial_finished(_study(), 90, "candidate", {}, eta=1.0, interval=(0.9, 1.1))
    assert stages["systems"].done == 78 and progress.probes == 80


def test_a_pinned_override_is_warned_once_a_study(caplog: pytest.LogCaptureFixture) -> None:
    from verl_sweep.launchers.run_dir import merge_overrides

    pins = ["trainer.save_freq=-1", "trainer.logger=[console,file]"]
    with caplog.at_level(logging.WARNING, logger="verl_sweep.launchers.run_dir"):
        for _ in range(48):  # 48 probes
            merged = merge_overrides(["trainer.save_freq=20", "trainer.logger=[console,wandb]", "a.b=1"], pins)
            assert merged == ["a.b=1", *pins]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned  # the loggers' pin keeps the caller's loggers: nothing to warn
    assert "dropping override 'trainer.save_freq=20' from every probe" in warned[0]


def test_exported_numbers_are_rounded_to_what_verl_needs() -> None:
    from verl_sweep.search.views.export import rounded

    assert rounded(0.8924589599619382) == 0.8925
    assert rounded(3.1622776e-06) == 3.162e-06
    assert rounded(512) == 512 and isinstance(rounded(512), int)
    assert rounded(True) is True and rounded("fsdp2") == "fsdp2"
    assert rounded({"a": [0.123456, 7]}) == {"a": [0.1235, 7]}


def test_one_driver_per_sqlite_file_and_a_dead_drivers_lock_is_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_sweep.search.spec.errors import BadInputError
    from verl_sweep.search.database.storage import DriverLock

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "study").mkdir()
    database = tmp_path / "study" / "demo.db"
    database.write_bytes(b"")
    url = f"sqlite:///{database}"
    found = database.stat()
    lock = tmp_path / "run" / "verl-sweep" / f"driver-{found.st_dev}-{found.st_ino}.lock"
    lock.parent.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(dead.stdout.strip())  # left by a driver that is gone
    with DriverLock(url):
        assert lock.read_text() == str(os.getpid())
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys; from verl_sweep.search.database.storage import DriverLock\n"
        f"with DriverLock({url!r}):\n    print('held', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (tmp_path / "link").symlink_to(tmp_path / "study")
        for other in (url, f"sqlite:///{tmp_path}/link/demo.db"):  # another path to the same file too
            with pytest.raises(BadInputError, match=r"^one driver per SQLite study database, but .*/demo.db is "
                                                    rf"driven by pid {holder.pid} already\. .*several workers need PostgreSQL"):
                with DriverLock(other):
                    pass
    finally:
        holder.communicate("", timeout=30)
    with DriverLock(url):  # released with its process
        pass
    assert sorted(p.name for p in (tmp_path / "study").iterdir()) == ["demo.db"]  # nothing beside the database


class _Stage:
    def __init__(self, name: str) -> None:
        self.name, self.space = name, name
