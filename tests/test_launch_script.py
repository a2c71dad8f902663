"""Reading a verl launch: a command line, or a script bash reads with none of its programs run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from search.errors import BadInputError
from search.launch_script import read_command, read_script


def _script(tmp_path: Path, text: str, name: str = "run.sh") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_command_line_keeps_the_overrides_in_order() -> None:
    command = read_command(["python3", "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer",
                            "data.train_batch_size=512", "+x.y={a: 1}", "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert command.overrides == ("data.train_batch_size=512", "+x.y={a: 1}", "actor_rollout_ref.actor.optim.lr=1e-6")
    assert command.config_name == "ppo_megatron_trainer"
    assert read_command(["uv", "run", "python3", "-m", "verl.trainer.main_ppo", "a=1"]).overrides == ("a=1",)
    assert read_command(["ray", "job", "submit", "--", "python", "-m", "verl.trainer.main_ppo", "a=1"]).overrides == ("a=1",)


def test_a_command_that_is_not_main_ppo_is_refused_in_one_line() -> None:
    with pytest.raises(BadInputError, match=r"the command must run verl\.trainer\.main_ppo .*but got `python3 train\.py a=1`"):
        read_command(["python3", "train.py", "a=1"])
    with pytest.raises(BadInputError, match=r"must be one run, but it has --multirun"):
        read_command(["python3", "-m", "verl.trainer.main_ppo", "--multirun", "a=1,2"])


def test_a_script_with_continuations_defaults_arrays_and_dropped_args(tmp_path: Path) -> None:
    path = _script(tmp_path, r"""#!/usr/bin/env bash
set -xeuo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
BATCH=${BATCH:-1024}
NGPUS=${NGPUS:-8}
LR=1e-6
ACTOR=(
    actor_rollout_ref.actor.optim.lr=${LR}
    actor_rollout_ref.actor.ppo_mini_batch_size=$((BATCH / 4))
)
if [ "${NGPUS}" -gt 4 ]; then ACTOR+=(actor_rollout_ref.rollout.tensor_model_parallel_size=2); fi
EXTRA="trainer.project_name=demo trainer.experiment_name=run_$(date +%Y%m%d)"
python3 -m verl.trainer.main_ppo \
    actor_rollout_ref.model.path=$MODEL \
    data.train_batch_size=${BATCH} \
    "${ACTOR[@]}" \
    $EXTRA \
    trainer.n_gpus_per_node=${NGPUS} "$@"
""")
    command = read_script(path)
    assert command.overrides == (
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B", "data.train_batch_size=1024",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.project_name=demo",
        "trainer.experiment_name=run_", "trainer.n_gpus_per_node=8",
    )
    assert any("`date +%Y%m%d` not run: no output" in u for u in command.unresolved)
    # the caller's environment is the script's, as when it runs; "$@" gets what follows the script
    os.environ["BATCH"] = "64"
    try:
        with_args = read_command(["bash", str(path), "trainer.total_epochs=2"])
    finally:
        del os.environ["BATCH"]
    assert "data.train_batch_size=64" in with_args.overrides and with_args.overrides[-1] == "trainer.total_epochs=2"


def test_no_program_of_the_script_runs(tmp_path: Path) -> None:
    """Every program is a stand-in, also one named by a path or a variable, also under exec:
    nothing is created, removed or started, and existing files are never truncated."""
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    marker = tmp_path / "ran"
    tool = tmp_path / "tool.sh"
    tool.write_text(f"#!/bin/sh\ntouch {marker}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    path = _script(tmp_path, f"""
{tool}
PY={tool}
$PY -c 'print(1)'
touch {marker}
rm -f {victim}
echo overwritten > {victim}
echo appended >> {victim}
DEVICE=$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)
exec python3 -m verl.trainer.main_ppo trainer.device=$DEVICE
""")
    command = read_script(path)
    assert command.overrides == ("trainer.device=gpu",)  # the probe for an NPU counts as failing
    assert not marker.exists()
    assert victim.read_text() == "precious"
    assert any("python3 -c import torch_npu` not run: taken as failing" in u for u in command.unresolved)


def test_an_unset_variable_is_left_empty_and_said(tmp_path: Path) -> None:
    path = _script(tmp_path, """set -u
python3 -m verl.trainer.main_ppo data.train_files=$DATA_DIR/train.parquet trainer.nnodes=1
""")
    command = read_script(path)
    assert command.overrides == ("data.train_files=/train.parquet", "trainer.nnodes=1")
    assert "$DATA_DIR is not set: left empty" in command.unresolved


def test_a_script_that_stops_before_verl_says_why(tmp_path: Path) -> None:
    path = _script(tmp_path, """: "${ADAPTER:?set ADAPTER to the LoRA adapter}"
python3 -m verl.trainer.main_ppo a=1
""")
    with pytest.raises(BadInputError, match=r"run\.sh: the script must reach a python3 -m verl\.trainer\.main_ppo call, but "
                                            r"it did not .*ADAPTER: set ADAPTER to the LoRA adapter"):
        read_script(path)
    other = _script(tmp_path, "python3 -m verl.trainer.main_ppo_sync a=1\n", "sync.sh")
    with pytest.raises(BadInputError, match=r"must call verl\.trainer\.main_ppo, but it runs verl\.trainer\.main_ppo_sync, "
                                            r"which verl 0\.9\.1 does not have \(`python3 -m verl\.trainer\.main_ppo_sync a=1`\)"):
        read_script(other)


def test_a_script_calling_verl_twice_uses_the_first_call(tmp_path: Path) -> None:
    path = _script(tmp_path, """for lr in 1e-6 2e-6; do python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.optim.lr=$lr; done
""")
    command = read_script(path)
    assert command.overrides == ("actor_rollout_ref.actor.optim.lr=1e-6",)
    assert command.notes == ("the script calls verl 2 times; the first call is used",)
