"""Reading a verl launch: a command line, or a script bash reads with none of its programs run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.commands.launch_script import read_command, read_script


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


# -- the shapes third-party launch scripts take (tests/data/third-party-scripts has real ones) --

def test_exports_tabs_plain_python_nested_quotes_and_a_tee(tmp_path: Path) -> None:
    path = _script(tmp_path, "#!/bin/bash\nset -x\nexport VLLM_ATTENTION_BACKEND=XFORMERS\n"
                   "export MODEL=${MODEL:-Qwen/Qwen3-8B}\nN_GPUS=${N_GPUS:-8}\n"
                   "python -m verl.trainer.main_ppo \\\n"
                   "\tdata.train_batch_size=256 \\\n"
                   "\tactor_rollout_ref.model.path=\"$MODEL\" \\\n"
                   "\ttrainer.logger='[\"console\",\"wandb\"]' \\\n"
                   "\t\"trainer.experiment_name='run a'\" \\\n"
                   "\ttrainer.n_gpus_per_node=$N_GPUS 2>&1 | tee \"logs/$(date +%F).log\"\n")
    assert read_script(path).overrides == (
        "data.train_batch_size=256", "actor_rollout_ref.model.path=Qwen/Qwen3-8B", 'trainer.logger=["console","wandb"]',
        "trainer.experiment_name='run a'", "trainer.n_gpus_per_node=8")


def test_ray_job_submit_with_a_json_runtime_env_and_verl_config_name(tmp_path: Path) -> None:
    path = _script(tmp_path, """HEAD=${HEAD:-127.0.0.1}
ray job submit --address="http://${HEAD}:8265" \\
  --runtime-env-json='{"env_vars": {"NCCL_DEBUG": "WARN", "http_proxy": ""}}' \\
  --no-wait \\
  -- python3 -m verl.trainer.main_ppo --config-path=config --config-name='ppo_megatron_trainer' \\
  algorithm.adv_estimator=grpo data.train_batch_size=128
""")
    command = read_script(path)
    assert (command.config_path, command.config_name) == ("config", "ppo_megatron_trainer")
    assert command.overrides == ("algorithm.adv_estimator=grpo", "data.train_batch_size=128")


def test_nohup_in_the_background_and_torchrun_under_uv(tmp_path: Path) -> None:
    background = _script(tmp_path, """mkdir -p logs
nohup python3 -m verl.trainer.main_ppo data.train_batch_size=64 trainer.nnodes=1 > logs/train.log 2>&1 &
echo "started $!"
wait
""")
    assert read_script(background).overrides == ("data.train_batch_size=64", "trainer.nnodes=1")
    launcher = _script(tmp_path, "uv run --frozen torchrun --nproc_per_node=8 -m verl.trainer.main_ppo a=1 \"$@\"\n",
                       "torchrun.sh")
    assert read_command(["bash", str(launcher), "b=2"]).overrides == ("a=1", "b=2")


def test_positional_arguments_a_case_and_a_function_around_the_call(tmp_path: Path) -> None:
    path = _script(tmp_path, """ENGINE=${1:-vllm}
shift || true
case $ENGINE in
  vllm) TP=2 ;;
  sglang) TP=4 ;;
  *) echo "unknown engine $ENGINE" >&2; exit 1 ;;
esac
train() {
  python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=$ENGINE \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=$TP "$@"
}
train trainer.total_epochs=1 "$@"
""")
    assert read_script(path).overrides == ("actor_rollout_ref.rollout.name=vllm",
                                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                           "trainer.total_epochs=1")
    assert read_command(["bash", str(path), "sglang", "trainer.nnodes=2"]).overrides == (
        "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "trainer.total_epochs=1", "trainer.nnodes=2")


def test_overrides_cut_off_by_a_comment_line_are_one_line_saying_so(tmp_path: Path) -> None:
    """bash ends a command at a comment line between continuation lines: what follows is run as
    a command of its own, and verl never gets it. A study of the shortened call would tune a run
    the user does not have."""
    path = _script(tmp_path, """python3 -m verl.trainer.main_ppo \\
    data.train_batch_size=128 \\
    # data.return_raw_chat=False \\
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \\
    trainer.total_epochs=15
""")
    with pytest.raises(BadInputError) as refused:
        read_script(path)
    assert str(refused.value) == (
        f"{path}: the verl call must hold all its overrides, but those from `actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-"
        "Instruct` on are a command of their own: the line before them ends the call (a comment line between "
        "continuation lines, or a line without `\\` at its end), so bash never passes them to verl. Join them to the call.")


def test_a_script_that_runs_its_own_trainer_says_which(tmp_path: Path) -> None:
    path = _script(tmp_path, """USE_PPO="algorithm.adv_estimator=gae"
python -m pip install -e . >/dev/null
python train.py --config-name _2_sokoban trainer.experiment_name=sokoban-ppo $USE_PPO &
wait
""")
    with pytest.raises(BadInputError) as refused:
        read_script(path)
    assert str(refused.value) == (f"{path}: the script must call verl.trainer.main_ppo, but it runs train.py instead "
                                  "(`python train.py --config-name _2_sokoban traine…`). verl-sweep tunes main_ppo "
                                  "runs: give that command.")


def test_an_override_left_empty_names_its_variable(tmp_path: Path) -> None:
    path = _script(tmp_path, """MODEL_DIR=$(ls -d /models/* | head -1)
python3 -m verl.trainer.main_ppo \\
actor_rollout_ref.model.path=$BASE_MODEL \\
critic.model.path="${MODEL_DIR}" \\
trainer.n_gpus_per_node=$N_GPUS trainer.nnodes=1
""")
    command = read_script(path)
    assert command.empty == (("actor_rollout_ref.model.path", "$BASE_MODEL is not set"),
                             ("critic.model.path", "$MODEL_DIR is empty"),
                             ("trainer.n_gpus_per_node", "$N_GPUS is not set"))
    assert command.why_empty("trainer.nnodes") == "a shell variable nobody set?"


def test_a_script_that_needs_an_argument_says_how_to_give_it(tmp_path: Path) -> None:
    path = _script(tmp_path, "set -euo pipefail\nMODEL=$1\npython3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=$MODEL\n")
    with pytest.raises(BadInputError, match=r"run\.sh: the script must reach its verl call, but it stops without argument "
                                            r"\$1 \(`set -u`: .*\)\. Give its arguments after it: verl-sweep init -o "
                                            r"study\.yaml -- bash .*run\.sh ARG …\.$"):
        read_script(path)
    assert read_command(["bash", str(path), "Qwen/Qwen3-8B"]).overrides == ("actor_rollout_ref.model.path=Qwen/Qwen3-8B",)
