"""docs/verl-resume.md's claims, checked by running verl 0.9.1's own code on a CPU.

The incumbent is a tiny HF causal LM wrapped in FSDP1 (``actor.strategy=fsdp``; one gloo rank,
so ``NO_SHARD``) whose optimizer and lr scheduler are built from verl's composed
``ppo_trainer`` config by verl's ``build_optimizer`` and ``FSDPEngine._build_lr_scheduler``. It
is saved and resumed by verl's ``FSDPCheckpointManager``, which loads the optimizer, then the
scheduler, as a resumed run does. ``data.pt`` and the tracker are written as
``PPOTrainer._save_checkpoint`` writes them (``trainer/ppo/v1/trainer_base.py``): that module
cannot be imported here (it needs the ``transfer_queue`` package, which verl's install does not
bring), so its source is read instead.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from verl_sweep.launchers.verl_checkpoints import branch_checkpoint
from verl_sweep.verl_knowledge import verl_available

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300),
              pytest.mark.skipif(not verl_available(), reason="verl is not installed")]

INCUMBENT_STEPS = 3
TOTAL_STEPS = 10
CONSTANT = ("actor_rollout_ref.actor.optim.lr_scheduler_type=constant",)
COSINE = ("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
          "actor_rollout_ref.actor.optim.min_lr_ratio=0.1")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo process group of one rank, as verl's checkpoint manager needs."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("process_group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _compose(*overrides: str) -> Any:
    """verl's ``ppo_trainer`` config with ``overrides``, the optimizer's horizon set as the trainer sets it."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=[
            f"trainer.total_training_steps={TOTAL_STEPS}",
            f"actor_rollout_ref.actor.optim.total_training_steps={TOTAL_STEPS}", *overrides])


class _Actor:
    """The actor's model, optimizer, scheduler and checkpoint manager, built from ``config`` as verl builds them."""

    def __init__(self, config: Any) -> None:
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from transformers import LlamaConfig, LlamaForCausalLM
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config.optimizer import build_optimizer
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2))
        self.model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
        optim_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor.optim)
        self.optimizer = build_optimizer(self.model.parameters(), optim_config)
        self.scheduler = FSDPEngine._build_lr_scheduler(SimpleNamespace(optimizer_config=optim_config, rank=1),
                                                        self.optimizer)
        self.manager = FSDPCheckpointManager(self.model, self.optimizer, self.scheduler,
                                             checkpoint_config=config.actor_rollout_ref.actor.checkpoint)

    def train_step(self, step: int) -> tuple[float, float]:
        """One training step on step ``step``'s batch (one mini-batch): the lr Adam used and the lr verl logs."""
        import torch

        batch = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(step))
        self.model(input_ids=batch, labels=batch).loss.backward()
        used = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()  # once per training step, after its optimizer steps
        return used, float(self.scheduler.get_last_lr()[0])

    def params(self) -> Any:
        import torch

        return torch.cat([p.detach().flatten().clone() for p in self.model.parameters()])


def _save_incumbent(config: Any, root: Path) -> Path:
    """Train ``INCUMBENT_STEPS`` steps and save ``root/global_step_N`` as verl's trainer does."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    actor = _Actor(config)
    loader = StatefulDataLoader(list(range(64)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    batches = iter(loader)
    for step in range(1, INCUMBENT_STEPS + 1):
        next(batches)
        actor.train_step(step)
    step_dir = root / f"global_step_{INCUMBENT_STEPS}"
    actor.manager.save_checkpoint(str(step_dir / "actor"), global_step=INCUMBENT_STEPS)
    torch.save(loader.state_dict(), step_dir / "data.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(INCUMBENT_STEPS))
    return step_dir


def _resume(config: Any, step_dir: Path) -> _Actor:
    actor = _Actor(config)
    actor.manager.load_checkpoint(str(step_dir / "actor"))
    return actor


@pytest.mark.parametrize("schedule", [CONSTANT, COSINE], ids=["constant", "cosine-warmup"])
def test_a_new_lr_applies_only_from_a_rewritten_copy(one_rank: None, tmp_path: Path, schedule: tuple[str, ...]) -> None:
    """§2: the checkpoint's lr wins over the branch's config; branch_checkpoint(lr=…) makes the
    branch's lr apply from its first step, and keeps the Adam moments, step counts and schedule position."""
    import torch

    old, new = 1e-4, 3e-4
    step_dir = _save_incumbent(_compose(*schedule, f"actor_rollout_ref.actor.optim.lr={old}"), tmp_path / "incumbent")
    branch_config = _compose(*schedule, f"actor_rollout_ref.actor.optim.lr={new}")
    saved = torch.load(step_dir / "actor" / "optim_world_size_1_rank_0.pt", weights_only=False)

    plain = _resume(branch_config, step_dir)
    copy = branch_checkpoint(step_dir, tmp_path / "branch", lr=new)
    branched = _resume(branch_config, copy.step_dir)

    shape = branched.scheduler.lr_lambdas[0]  # the new config's schedule (a closure: never saved)
    assert branched.scheduler.last_epoch == plain.scheduler.last_epoch == INCUMBENT_STEPS
    for actor in (plain, branched):
        state = actor.optimizer.state_dict()["state"]
        assert state.keys() == saved["state"].keys()
        for index, moments in saved["state"].items():
            for name, value in moments.items():
                assert torch.equal(state[index][name], value), (index, name)
        assert float(state[0]["step"]) == INCUMBENT_STEPS

    before = plain.params()
    assert torch.equal(before, branched.params())
    used, logged = plain.train_step(INCUMBENT_STEPS + 1)
    assert used == pytest.approx(old * shape(INCUMBENT_STEPS))  # the branch's config says 3e-4: not applied
    assert logged == pytest.approx(old * shape(INCUMBENT_STEPS + 1))
    used, logged = branched.train_step(INCUMBENT_STEPS + 1)
    assert used == pytest.approx(new * shape(INCUMBENT_STEPS))
    assert logged == pytest.approx(new * shape(INCUMBENT_STEPS + 1))
    # same moments, gradients and weights: AdamW's update (decay included) is linear in lr; each
    # element moves by about lr, and float32 weights near 1 round to ~1e-7
    torch.testing.assert_close(branched.params() - before, (plain.params() - before) * (new / old),
                               rtol=1e-3, atol=1e-6)
    assert float(branched.optimizer.state_dict()["state"][0]["step"]) == INCUMBENT_STEPS + 1


def test_the_copy_links_what_it_does_not_rewrite(one_rank: None, tmp_path: Path) -> None:
    step_dir = _save_incumbent(_compose(*CONSTANT), tmp_path / "incumbent")
    files = {p.relative_to(step_dir): p for p in step_dir.rglob("*") if p.is_file()}
    rewritten = {Path("actor/optim_world_size_1_rank_0.pt"), Path("actor/extra_state_world_size_1_rank_0.pt")}
    assert {Path("actor/model_world_size_1_rank_0.pt"), Path("actor/huggingface/config.json"), Path("data.pt"),
            Path("actor/fsdp_config.json"), *rewritten} <= files.keys()

    copy = branch_checkpoint(step_dir, tmp_path / "branch", lr=2e-6)
    assert copy.step_dir == tmp_path / "branch" / "global_step_3"
    assert (tmp_path / "branch" / "latest_checkpointed_iteration.txt").read_text() == "3"
    for name, src in files.items():
        assert os.path.samefile(src, copy.step_dir / name) == (name not in rewritten), name
    assert copy.n_bytes_copied == sum((copy.step_dir / n).stat().st_size for n in rewritten)
    assert copy.n_bytes_linked == sum(files[n].stat().st_size for n in files.keys() - rewritten)

    same = branch_checkpoint(step_dir, tmp_path / "same-lr")
    assert same.n_bytes_copied == 0 and all(os.path.samefile(p, same.step_dir / n) for n, p in files.items())


def test_mini_batch_and_kl_come_from_the_branch_config(one_rank: None, tmp_path: Path) -> None:
    """§3-4: no file verl writes holds the mini-batch or a KL coefficient, verl's save and load
    code touches neither, and verl builds both from the (branch's) config."""
    from verl.trainer.ppo.core_algos import get_kl_controller
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.config import omega_conf_to_dataclass

    def config(mini_batch: int, kl_loss_coef: float, kl_coef: float) -> Any:
        return _compose(*CONSTANT, "data.train_batch_size=1440",
                        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                        "actor_rollout_ref.actor.use_kl_loss=true",
                        f"actor_rollout_ref.actor.kl_loss_coef={kl_loss_coef}",
                        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                        f"algorithm.kl_ctrl.kl_coef={kl_coef}")

    incumbent = config(720, 0.00123, 0.00456)
    step_dir = _save_incumbent(incumbent, tmp_path / "incumbent")
    keys, values = _contents(step_dir)
    assert not keys & {"ppo_mini_batch_size", "kl_loss_coef", "kl_coef", "kl_ctrl", "kl_ctrl_in_reward", "use_kl_loss"}
    assert not values & {720, 0.00123, 0.00456}
    assert {"param_groups", "lr_scheduler", "rng", "base_lrs"} <= keys  # the scan does see into the files

    # what verl's save code writes: the manager's three shards, and the trainer's data.pt and tracker
    manager = ast.parse(inspect.cleandoc("\n" + inspect.getsource(FSDPCheckpointManager.save_checkpoint)))
    saved = {ast.unparse(c.args[0]) for c in _calls(manager, "torch.save")}
    assert saved == {"model_state_dict", "optimizer_state_dict", "extra_state_dict"}
    extra = next(n.value for n in ast.walk(manager) if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "extra_state_dict")
    assert {ast.literal_eval(k) for k in extra.keys} == {"lr_scheduler", "rng"}  # type: ignore[attr-defined]
    trainer = _method_sources()
    assert [ast.unparse(c.args[0]) for c in _calls(trainer["_save_checkpoint"], "torch.save")] == [
        "self.train_dataloader.state_dict()"]
    for method in ("_save_checkpoint", "_load_checkpoint"):
        assert "kl_ctrl" not in ast.unparse(trainer[method]) and "mini_batch" not in ast.unparse(trainer[method])
    built = [ast.unparse(n.value) for n in ast.walk(trainer["__init__"]) if isinstance(n, ast.Assign)
             and ast.unparse(n.targets[0]) == "self.kl_ctrl_in_reward"]
    assert built == ["core_algos.get_kl_controller(self.config.algorithm.kl_ctrl)"]

    # the branch resumes from the incumbent's files and builds both from its own config
    branch = config(360, 0.0111, 0.0055)
    _resume(branch, branch_checkpoint(step_dir, tmp_path / "branch").step_dir)
    actor = omega_conf_to_dataclass(branch.actor_rollout_ref.actor)  # as engine_workers.py builds the actor's
    assert (actor.ppo_mini_batch_size, actor.kl_loss_coef) == (360, 0.0111)
    assert get_kl_controller(branch.algorithm.kl_ctrl).value == 0.0055  # adaptive: restarts at the config's


def _contents(step_dir: Path) -> tuple[set[str], set[Any]]:
    """Every key and string, and every plain number, in every file of ``step_dir`` (tensors and arrays left out)."""
    import torch

    keys: set[str] = set()
    values: set[Any] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            keys.update(k for k in node if isinstance(k, str))
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            keys.add(node)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            values.add(node)

    for path in step_dir.rglob("*"):
        if path.suffix == ".pt":
            walk(torch.load(path, weights_only=False))
        elif path.suffix == ".json":
            walk(json.loads(path.read_text()))
    return keys, values


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == name]


def _method_sources() -> dict[str, ast.FunctionDef]:
    """The methods of verl's v1 trainer base class, parsed from its installed source."""
    import verl

    path = Path(verl.__file__).parent / "trainer" / "ppo" / "v1" / "trainer_base.py"
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
