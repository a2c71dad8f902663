"""``verl-sweep init``: a study file from the verl run a user already has, validated."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from support import REPO, cli
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.commands.init import build_study, render
from verl_sweep.search.commands.launch_script import LaunchCommand, read_command
from verl_sweep.search.spec.study_file import load_study
from verl_sweep.search.commands.validate import validate_study

CONFIGS = REPO / "tests" / "data" / "model-configs"
MAIN = ["python3", "-m", "verl.trainer.main_ppo"]


def model_dir(tmp_path: Path, name: str = "Qwen--Qwen3-8B") -> Path:
    directory = tmp_path / name
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIGS / f"{name}.json", directory / "config.json")
    return directory


def hf_cache(tmp_path: Path, *names: str) -> Path:
    """A local Hugging Face cache holding only the models' config.json (init reads nothing else)."""
    hub = tmp_path / "hub"
    for name in names:
        snapshot = hub / f"models--{name}" / "snapshots" / "0123abc"
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy(CONFIGS / f"{name}.json", snapshot / "config.json")
        (hub / f"models--{name}" / "refs").mkdir(exist_ok=True)
        (hub / f"models--{name}" / "refs" / "main").write_text("0123abc")
    return hub


def grpo_overrides(model: str, **extra: Any) -> list[str]:
    items = {
        "algorithm.adv_estimator": "grpo", "data.train_batch_size": 512, "data.max_prompt_length": 1024,
        "data.max_response_length": 2048, "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.actor.optim.lr": "1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size": 128,
        "actor_rollout_ref.actor.use_dynamic_bsz": "True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 24576,
        "actor_rollout_ref.actor.use_kl_loss": "True", "actor_rollout_ref.actor.kl_loss_coef": 0.001,
        "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.n": 5,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6, "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 1, "trainer.total_epochs": 15,
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]


def build(tmp_path: Path, overrides: list[str], **kw: Any) -> tuple[dict[str, Any], list[str]]:
    result = build_study(LaunchCommand(tuple(overrides)), name="t", gpu_memory_gb=80, **kw)
    return result.data, result.remarks


def test_init_from_a_command_line(tmp_path: Path) -> None:
    """The README's "from your verl command": the overrides become the baseline unchanged
    (numbers stay numbers, 1e-6 too), the facts are read off them and the model's config.json,
    and validate runs and says what will be searched, how many probes, at what estimated cost."""
    model = model_dir(tmp_path)
    out = tmp_path / "study.yaml"
    result = cli("init", "-o", str(out), "--gpu-memory-gb", "80", "--", *MAIN,
                 *grpo_overrides(str(model), **{"algorithm.adv_estimator": "rloo"}), cwd=tmp_path)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-2000:])
    data = yaml.safe_load(out.read_text())
    baseline = data["baseline"]
    assert baseline["actor_rollout_ref.actor.optim.lr"] == 1e-6 and isinstance(baseline["data.train_batch_size"], int)
    assert baseline["actor_rollout_ref.actor.use_kl_loss"] is True
    assert data["algorithm"] == "grpo" and baseline["algorithm.adv_estimator"] == "rloo"  # the GRPO-style chain
    assert data["hardware"] == {"gpus_per_node": 8, "nodes": 1, "gpu_memory_gb": 80.0}
    assert data["model"]["hidden_size"] == 4096 and data["model"]["num_key_value_heads"] == 8
    assert (data["model"]["max_prompt_length"], data["model"]["max_response_length"]) == (1024, 2048)
    assert [s["space"] for s in data["stages"]] == ["systems", "token_budget", "mini_batch", "kl", "lr", "polish"]
    assert re.search(r"plan: up to \d+ probes .* ESTIMATE [\d,]+-[\d,]+ GPU-hours = [\d.]+-[\d.]+ R at ~\d+ s a step "
                     r"\(R: [\d,]+ steps( assumed)?\)\n", result.stdout), result.stdout[-2000:]
    assert re.search(r"plan: ~\d+ s a step is an estimate: ", result.stdout)
    assert f"{out}: OK" in result.stdout
    assert load_study(out).baseline == baseline


def test_init_from_a_script_reads_the_model_from_the_local_hugging_face_cache(tmp_path: Path) -> None:
    hub = hf_cache(tmp_path, "Qwen--Qwen3-8B")
    script = tmp_path / "run_qwen.sh"
    script.write_text("MODEL=${MODEL:-Qwen/Qwen3-8B}\npython3 -m verl.trainer.main_ppo \\\n    "
                      + " \\\n    ".join(grpo_overrides("$MODEL")) + ' \\\n    "$@"\n')
    out = tmp_path / "study.yaml"
    result = cli("init", "-o", str(out), "--gpu-memory-gb", "80", str(script), cwd=tmp_path,
                 env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-2000:])
    assert f"model facts from {hub}" in result.stdout
    assert yaml.safe_load(out.read_text())["model"]["num_hidden_layers"] == 36


def test_what_init_cannot_know_is_one_line_each(tmp_path: Path) -> None:
    out = tmp_path / "study.yaml"
    missing = cli("init", "-o", str(out), "--gpu-memory-gb", "80", "--", *MAIN, *grpo_overrides("Org/NoSuchModel"),
                  cwd=tmp_path, env={"HF_HUB_CACHE": str(tmp_path / "empty-hub")})
    assert missing.returncode == 2 and not out.exists()
    assert missing.stderr.strip().splitlines() == [
        "error: actor_rollout_ref.model.path=Org/NoSuchModel: init reads the model's config.json from a local directory "
        "or the local Hugging Face cache (never the network), but the local Hugging Face cache has none. Pass "
        "--model-config PATH/config.json."]
    with pytest.raises(BadInputError, match=r"init needs one GPU's memory, but it sees no GPU here \(NVML\)\. Pass "
                                            r"--gpu-memory-gb"):
        build_study(LaunchCommand(tuple(grpo_overrides(str(model_dir(tmp_path))))), name="t")
    with pytest.raises(BadInputError, match=r"--config-name my_trainer: must be one of verl's ppo_trainer, "
                                            r"ppo_megatron_trainer"):
        build_study(read_command([*MAIN, "--config-name=my_trainer", "a=1"]), name="t", gpu_memory_gb=80)
    with pytest.raises(BadInputError, match=r"`k=1,2`: must be one value, but it is a Hydra sweep"):
        build(tmp_path, ["k=1,2"])


def test_a_model_path_left_empty_by_the_script_names_the_variable(tmp_path: Path) -> None:
    """TinyZero's scripts read the model from $BASE_MODEL, which its README asks to export:
    without it the line says which variable, not that the command lacks the key."""
    script = tmp_path / "train.sh"
    script.write_text("python3 -m verl.trainer.main_ppo \\\nactor_rollout_ref.model.path=$BASE_MODEL \\\n"
                      "trainer.n_gpus_per_node=$N_GPUS trainer.nnodes=1 2>&1 | tee verl_demo.log\n")
    out = tmp_path / "study.yaml"
    result = cli("init", "-o", str(out), "--gpu-memory-gb", "80", str(script), cwd=tmp_path)
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip().splitlines() == [
        "error: actor_rollout_ref.model.path must name the model, but the command leaves it empty ($BASE_MODEL is not "
        "set). Set it, or pass --model-config PATH/config.json."]


def test_the_stages_fit_the_config(tmp_path: Path) -> None:
    model = str(model_dir(tmp_path))
    spaces = lambda data: [s["space"] for s in data["stages"]]  # noqa: E731
    sglang, remarks = build(tmp_path, grpo_overrides(model, **{"actor_rollout_ref.rollout.name": "sglang"}))
    assert "token_budget" not in spaces(sglang)
    assert any("no token-budget stage: verl 0.9.1 never passes rollout.max_num_batched_tokens to sglang" in r for r in remarks)
    veomni, remarks = build(tmp_path, grpo_overrides(model, model_engine="veomni"))
    assert "systems" not in spaces(veomni)
    assert any("no systems stage: model_engine=veomni lays out its own mesh, which stage 0 cannot search yet" in r
               for r in remarks)
    ppo, _ = build(tmp_path, grpo_overrides(model, **{"algorithm.adv_estimator": "gae",
                                                       "critic.ppo_micro_batch_size_per_gpu": 4}))
    assert ppo["algorithm"] == "ppo" and spaces(ppo)[-2:] == ["lam", "polish"]
    assert "lam" not in spaces(build(tmp_path, grpo_overrides(model))[0])  # λ only with GAE
    megatron = build_study(read_command([*MAIN, "--config-path=config", "--config-name=ppo_megatron_trainer",
                                         *grpo_overrides(model)]), name="t", gpu_memory_gb=80).data
    assert megatron["baseline"]["model_engine"] == "megatron" and spaces(megatron)[0] == "systems"


def test_the_kl_stage_tunes_the_key_in_use(tmp_path: Path) -> None:
    """A GRPO-style run with the KL in the reward (not the KL loss): the KL stage moves
    algorithm.kl_ctrl.kl_coef, with its controller."""
    from verl_sweep.spaces import build_space

    data, _ = build(tmp_path, grpo_overrides(str(model_dir(tmp_path)), **{
        "actor_rollout_ref.actor.use_kl_loss": "False", "algorithm.use_kl_in_reward": "True",
        "algorithm.kl_ctrl.kl_coef": 0.002}))
    spec = load_study(_write(tmp_path, data))
    space = build_space("kl", model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                        base=spec.baseline_config(), options={})
    assert (space.switch_key, space.coef_key) == ("algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef")


def _write(tmp_path: Path, data: dict[str, Any], name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _train_file(tmp_path: Path, rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(rows)]}), path)
    return path


def test_probes_fit_the_105_step_run(tmp_path: Path) -> None:
    """7,473 prompts at batch 1,024 for 15 epochs is 105 steps (the last partial batch dropped):
    learning probes of 500 would each be the whole run. init shortens them to ¼ of it, a slow
    start's to ½, scales the pruner with them, and says so; the study validates."""
    train = _train_file(tmp_path, 7473)
    data, remarks = build(tmp_path, grpo_overrides(str(model_dir(tmp_path)), **{
        "data.train_files": str(train), "data.train_batch_size": 1024, "actor_rollout_ref.actor.ppo_mini_batch_size": 256}))
    assert data["probe"] == {"steps": 26, "speed_steps": 26}  # the slow-start factor 2 is the default
    assert any(re.search(r"the run is 105 steps \(15 epochs × \(7,473 prompts ÷ batch 1024 = 7 steps\) = 105 steps\): "
                         r"learning probes 500 → 26 steps \(¼ of the run\)", r) for r in remarks), remarks
    minibatch = next(s for s in data["stages"] if s["space"] == "mini_batch")
    assert minibatch["pruner"] == {"warmup_steps": 5, "interval_steps": 1}
    spec = load_study(_write(tmp_path, data))
    problems, lines = validate_study(spec, with_verl=False)
    assert problems == [] and not any("over ¼ of the run" in line for line in lines)


def test_a_run_too_short_for_learning_probes_gets_a_speed_only_study(tmp_path: Path) -> None:
    """15 steps (the ascend PPO smoke run's) hold no learning probe (10 scored steps in ¼ of the
    run need 40) but speed probes: the study keeps the speed stages that apply, one remark says
    so and what to set for the rest, and it validates; its final check runs speed probes."""
    model = str(model_dir(tmp_path))
    data, remarks = build(tmp_path, grpo_overrides(model, **{"trainer.total_training_steps": 15}))
    assert [s["space"] for s in data["stages"]] == ["systems", "token_budget"]
    assert data["probe"] == {"speed_steps": 3}  # one warm-up step and two scored
    assert any(re.fullmatch(r"the run is 15 steps \(trainer\.total_training_steps = 15\), too short for learning probes "
                            r"\(≥ 40 steps needed: 10 scored steps in ¼ of the run\): the study tunes speed only, with "
                            r"3-step speed probes: systems \(systems\), tokens \(token_budget\)\. For the learning stages "
                            r"too, set trainer\.total_training_steps ≥ 40 \(or more trainer\.total_epochs\)\.", r)
               for r in remarks), remarks
    problems, lines = validate_study(load_study(_write(tmp_path, data)), with_verl=False)
    assert problems == [], problems
    assert any(line.startswith("plan: systems (systems) ") for line in lines), lines
    assert any(line.startswith("plan: final (final config against the baseline, on throughput) 4 probes × 3 steps: ")
               for line in lines), lines

    # No speed stage applies (VeOmni lays out its own mesh, SGLang never reads the token budget).
    with pytest.raises(BadInputError) as refused:
        build(tmp_path, grpo_overrides(model, model_engine="veomni", **{
            "trainer.total_training_steps": 15, "actor_rollout_ref.rollout.name": "sglang"}))
    assert re.fullmatch(r"the run is 15 steps \(trainer\.total_training_steps = 15\), too short for learning probes .*, "
                        r"and no speed stage applies \(no systems stage: model_engine=veomni .*; no token-budget stage: "
                        r"verl 0\.9\.1 never passes rollout\.max_num_batched_tokens to sglang .*\)\. To tune this run, "
                        r"set trainer\.total_training_steps ≥ 40 \(or more trainer\.total_epochs\)\.", str(refused.value))


def test_init_writes_a_speed_only_study_that_validates(tmp_path: Path) -> None:
    out = tmp_path / "study.yaml"
    result = cli("init", "-o", str(out), "--gpu-memory-gb", "80", "--", *MAIN,
                 *grpo_overrides(str(model_dir(tmp_path)), **{"trainer.total_training_steps": 15}), cwd=tmp_path)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-2000:])
    assert "the study tunes speed only" in result.stdout and f"{out}: OK" in result.stdout
    assert "the study tunes speed only" in out.read_text()  # the header says it too


def test_a_run_too_short_for_any_probe_is_one_line_saying_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(BadInputError) as refused:
        build(tmp_path, grpo_overrides(str(model_dir(tmp_path)), **{"trainer.total_training_steps": 5}))
    assert str(refused.value) == (
        "the run must be at least 6 steps for speed probes of 3 steps (½ of the run at most), but it is 5 "
        "(trainer.total_training_steps = 5). Set trainer.total_training_steps ≥ 40 for every stage (≥ 6 for the speed "
        "stages alone), or more trainer.total_epochs.")


def test_a_100_step_run_keeps_every_stage_with_its_probes_shortened(tmp_path: Path) -> None:
    data, remarks = build(tmp_path, grpo_overrides(str(model_dir(tmp_path)), **{"trainer.total_training_steps": 100}))
    assert [s["space"] for s in data["stages"]] == ["systems", "token_budget", "mini_batch", "kl", "lr", "polish"]
    assert data["probe"] == {"steps": 25, "speed_steps": 25}  # the slow-start factor 2 is the default
    assert "the run is 100 steps (trainer.total_training_steps = 100): learning probes 500 → 25 steps (¼ of the run), " \
           "speed probes 30 → 25 steps" in remarks
    # a larger slow-start factor is cut so that a lengthened probe stays within half the run
    from verl_sweep.search.method.run_length import RunLength, fit_probes

    fit = fit_probes(RunLength(100, "trainer.total_training_steps = 100"), steps=500, speed_steps=30, slow_start_factor=4,
                     min_steps=10, min_speed_steps=3)
    assert not isinstance(fit, str) and (fit.steps, fit.slow_start_factor) == (25, 2)
    assert "slow-start factor 4 → 2 (a longer probe stays ≤ ½ of the run)" in fit.note
    problems, _ = validate_study(load_study(_write(tmp_path, data)), with_verl=False)
    assert problems == []


def test_validate_refuses_probes_as_long_as_the_run(tmp_path: Path) -> None:
    data, _ = build(tmp_path, grpo_overrides(str(model_dir(tmp_path)), **{"trainer.total_training_steps": 400}))
    data["probe"]["steps"] = 500
    problems, _ = validate_study(load_study(_write(tmp_path, data)), with_verl=False)
    assert any(re.search(r"^probe\.steps: probes of stage minibatch must be shorter than the run \(400 steps: "
                         r"trainer\.total_training_steps = 400\), but are 500 steps, each the whole run\. Set it ≤ 100", p)
               for p in problems), problems


def test_a_yaml_1e_6_is_the_number_meant(tmp_path: Path) -> None:
    data, _ = build(tmp_path, grpo_overrides(str(model_dir(tmp_path))))
    text = yaml.safe_dump(data, sort_keys=False).replace("actor_rollout_ref.actor.optim.lr: 1.0e-06",
                                                          "actor_rollout_ref.actor.optim.lr: 1e-6")
    assert "optim.lr: 1e-6" in text
    path = tmp_path / "hand.yaml"
    path.write_text(text)
    assert load_study(path).baseline["actor_rollout_ref.actor.optim.lr"] == 1e-6


def test_lengths_are_one_fact(tmp_path: Path) -> None:
    data, _ = build(tmp_path, grpo_overrides(str(model_dir(tmp_path))))
    data["model"]["max_prompt_length"] = 512
    with pytest.raises(BadInputError, match=r"model\.max_prompt_length: must equal the baseline's data\.max_prompt_length "
                                            r"\(1024\), but got 512"):
        load_study(_write(tmp_path, data))
    del data["model"]["max_prompt_length"]  # taken from the baseline
    assert load_study(_write(tmp_path, data)).model.max_prompt_length == 1024


def test_the_study_file_says_what_init_could_not_resolve(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f'python3 -m verl.trainer.main_ppo {" ".join(grpo_overrides(str(model_dir(tmp_path))))} '
                      'trainer.experiment_name=x_$(date +%s) data.val_files=$VAL/test.parquet\n')
    result = build_study(read_command([str(script)]), name="t", gpu_memory_gb=80)
    text = render(result, source=str(script))
    assert "# could not resolve `date +%s` not run: no output" in text
    assert "# could not resolve $VAL is not set: left empty" not in text  # no `set -u`: bash leaves it empty itself
    assert yaml.safe_load(text)["baseline"]["data.val_files"] == "/test.parquet"


def test_the_corpus_facts_parse() -> None:
    """Every model stand-in gives the shape the bounds need (tests/data/model-configs)."""
    from verl_sweep.verl_knowledge import facts_from_config

    for path in CONFIGS.glob("*.json"):
        facts = facts_from_config(json.loads(path.read_text()))
        assert facts["num_hidden_layers"] >= 1 and facts["n_params_b"] > 0, path


def test_status_explains_a_stage_whose_probes_all_ended_early(tmp_path: Path) -> None:
    """A run whose length validate cannot see (its rows are not local: the simulator's 120,000
    prompts, 29 steps an epoch at batch 4,096) and probes longer than it: every probe ends with
    the run, and status says why the stage found nothing."""
    from support import demo_data, write_study

    data = demo_data()
    data.update(name="short", launcher={"kind": "replay", "max_concurrent": 2, "options": {}},
                probe={"steps": 60, "incumbent_repeats": 2})
    data["baseline"].update({"data.train_batch_size": 4096, "trainer.total_epochs": 1})
    data["stages"] = [{"name": "minibatch", "space": "mini_batch", "budget": {"max_trials": 3}, "confirm_top": 0,
                       "pruner": {"name": "none"}}]
    data.pop("stop_when_flat", None)
    path = write_study(tmp_path, data, "short.yaml")
    assert cli("run", str(path), cwd=tmp_path, timeout=600).returncode == 0
    status = cli("status", "short", "--storage", f"sqlite:///{tmp_path}/short.db", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert re.search(r"every probe of this stage ended before its 60 steps \(the furthest at step 29\): the run itself "
                     r"stops there", status.stdout), status.stdout[-2000:]
