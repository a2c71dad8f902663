"""branch_checkpoint on files laid out as verl 0.9.1 saves them, made with torch alone (a real
AdamW and LambdaLR; the verl-built ones are in test_verl_checkpoints_resume.py): what it writes,
and its errors. Importing the module never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from support import REPO
from verl_sweep.launchers.base import Branch, LauncherError
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.launchers.verl_checkpoints import VerlCheckpointError, branch_checkpoint, prepare_branch

pytestmark = pytest.mark.fast
torch = pytest.importorskip("torch")

N = 4
OLD_LR = 1e-4
WARMUP = 8  # the incumbent is still warming up: _last_lr is below base_lrs


def _incumbent(root: Path, *, world_size: int = 2) -> Path:
    """``root/global_step_N`` with verl's file names, one shard set per rank."""
    step_dir = root / f"global_step_{N}"
    actor = step_dir / "actor"
    (actor / "huggingface").mkdir(parents=True)
    for rank in range(world_size):
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=OLD_LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / WARMUP))
        for _ in range(N):
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        shard = f"world_size_{world_size}_rank_{rank}.pt"
        torch.save(model.state_dict(), actor / f"model_{shard}")
        torch.save(optimizer.state_dict(), actor / f"optim_{shard}")
        torch.save({"lr_scheduler": scheduler.state_dict(), "rng": {"cpu": torch.get_rng_state()}},
                   actor / f"extra_state_{shard}")
    (actor / "huggingface" / "config.json").write_text("{}")
    torch.save({"samples_yielded": 64}, step_dir / "data.pt")
    return step_dir


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def test_rewrites_the_lr_and_keeps_the_rest(tmp_path: Path) -> None:
    src = _incumbent(tmp_path / "incumbent")
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    copy = branch_checkpoint(src, tmp_path / "branch", lr=3e-4)
    assert copy.step_dir == tmp_path / "branch" / "global_step_4"
    assert (tmp_path / "branch" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before  # the incumbent's files unchanged
    assert not list((tmp_path / "branch").glob(".*"))
    for rank in (0, 1):
        shard = f"world_size_2_rank_{rank}.pt"
        old, new = _load(src / "actor" / f"optim_{shard}"), _load(copy.step_dir / "actor" / f"optim_{shard}")
        assert [(g["lr"], g["initial_lr"]) for g in new["param_groups"]] == [
            pytest.approx((3e-4 * N / WARMUP, 3e-4))]
        assert [{k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in new["param_groups"]] == [
            {k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in old["param_groups"]]
        for index, moments in old["state"].items():
            assert all(torch.equal(new["state"][index][k], v) for k, v in moments.items())
        old = _load(src / "actor" / f"extra_state_{shard}")
        new = _load(copy.step_dir / "actor" / f"extra_state_{shard}")
        assert new["lr_scheduler"]["base_lrs"] == [3e-4]
        assert new["lr_scheduler"]["_last_lr"] == pytest.approx([3e-4 * N / WARMUP])
        assert new["lr_scheduler"]["last_epoch"] == old["lr_scheduler"]["last_epoch"] == N
        assert torch.equal(new["rng"]["cpu"], old["rng"]["cpu"])


def test_links_every_file_it_does_not_rewrite(tmp_path: Path) -> None:
    src = _incumbent(tmp_path / "incumbent")
    files = {p.relative_to(src): p for p in src.rglob("*") if p.is_file()}
    copy = branch_checkpoint(src, tmp_path / "branch", lr=3e-4)
    rewritten = {name for name in files if name.name.startswith(("optim_", "extra_state_"))}
    assert len(rewritten) == 4
    for name, path in files.items():
        assert (path.stat().st_ino == (copy.step_dir / name).stat().st_ino) == (name not in rewritten), name
    assert copy.n_bytes_copied == sum((copy.step_dir / name).stat().st_size for name in rewritten)
    assert copy.n_bytes_linked == sum(files[name].stat().st_size for name in files.keys() - rewritten)

    plain = branch_checkpoint(src, tmp_path / "plain")
    assert plain.n_bytes_copied == 0 and plain.n_bytes_linked == sum(p.stat().st_size for p in files.values())


def test_a_branch_run_gets_its_own_copy_in_its_run_dir_each_attempt(tmp_path: Path) -> None:
    """What the local launcher does as it starts a branch run (``prepare_branch``): the copy its
    pins resume, linked but for the rewritten shards; a restarted attempt replaces it."""
    src = _incumbent(tmp_path / "incumbent")
    run_dir = RunDir.make(tmp_path / "runs", "b")
    assert prepare_branch(Branch(None, save_every=2), run_dir) is None and not run_dir.resume.exists()
    for lr in (3e-4, 5e-4):  # two attempts of one run
        copy = prepare_branch(Branch(str(src), save_every=2, lr=lr), run_dir)
        assert copy == run_dir.resume_step_dir(str(src)) == run_dir.resume / "global_step_4"
        assert sorted(p.name for p in run_dir.resume.iterdir()) == ["global_step_4", "latest_checkpointed_iteration.txt"]
        model = Path("actor/model_world_size_2_rank_0.pt")
        assert (copy / model).stat().st_ino == (src / model).stat().st_ino
        assert _load(copy / "actor/extra_state_world_size_2_rank_0.pt")["lr_scheduler"]["base_lrs"] == [lr]


def _corrupt_optimizer(step_dir: Path) -> Path:
    path = step_dir / "actor" / "optim_world_size_2_rank_1.pt"
    path.write_bytes(b"not a torch file\n")
    return path


def _optimizer_without_groups(step_dir: Path) -> Path:
    path = step_dir / "actor" / "optim_world_size_2_rank_0.pt"
    torch.save({"state": {}}, path)
    return path


def _extra_without_scheduler(step_dir: Path) -> Path:
    path = step_dir / "actor" / "extra_state_world_size_2_rank_0.pt"
    torch.save({"lr_scheduler": None, "rng": {}}, path)
    return path


def _no_extra_state(step_dir: Path) -> Path:
    for path in (step_dir / "actor").glob("extra_state_*"):
        path.unlink()
    return step_dir / "actor"


BAD: list[tuple[str, Callable[[Path], Path], str]] = [
    ("corrupt shard", _corrupt_optimizer,
     r"optim_world_size_2_rank_1\.pt must be a file torch can load, but loading failed \(UnpicklingError: .*\)\. "
     r"Branch from another step, or re-save this one\."),
    ("no param groups", _optimizer_without_groups,
     r"optim_world_size_2_rank_0\.pt must hold an optimizer state whose param_groups carry lr and initial_lr, "
     r"but it does not \(KeyError: 'param_groups'\)\. Branch without lr"),
    ("no scheduler state", _extra_without_scheduler,
     r"extra_state_world_size_2_rank_0\.pt must hold an lr_scheduler state with base_lrs and _last_lr, but it does "
     r"not \(TypeError: "),
    ("no extra state", _no_extra_state,
     r"Setting a branch's lr needs actor/extra_state_world_size_\*_rank_\*\.pt in the checkpoint, but .*/actor has "
     r"none\. Branch without lr, or from a save whose checkpoint\.save_contents has optimizer and extra\."),
]


@pytest.mark.parametrize("name, spoil, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_shard_fails_naming_it_and_leaves_nothing(tmp_path: Path, name: str, spoil: Callable[[Path], Path],
                                                        message: str) -> None:
    src = _incumbent(tmp_path / "incumbent")
    named = spoil(src)
    with pytest.raises(VerlCheckpointError, match=message) as caught:
        branch_checkpoint(src, tmp_path / "branch", lr=3e-4)
    assert str(named) in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "branch").exists() or list((tmp_path / "branch").iterdir()) == []


def test_a_folder_verl_cannot_resume_fails(tmp_path: Path) -> None:
    src = _incumbent(tmp_path / "incumbent")
    with pytest.raises(VerlCheckpointError, match=r"must be named global_step_N \(verl reads N from the name\), but "
                       r"got .*/incumbent\. Pass the global_step_N folder under trainer\.default_local_dir\."):
        branch_checkpoint(src.parent, tmp_path / "branch")
    with pytest.raises(VerlCheckpointError, match=r"must exist, but .*/global_step_9 is not a directory\. Pass a "
                       r"global_step_N folder that verl saved\."):
        branch_checkpoint(src.parent / "global_step_9", tmp_path / "branch")
    (tmp_path / "empty" / "global_step_2" / "actor").mkdir(parents=True)
    with pytest.raises(VerlCheckpointError, match=r"must hold actor/model_world_size_W_rank_R\.pt shards, but "
                       r".*/global_step_2/actor has none\. Branch from a step whose save finished\."):
        branch_checkpoint(tmp_path / "empty" / "global_step_2", tmp_path / "branch")
    branch_checkpoint(src, tmp_path / "branch")
    with pytest.raises(VerlCheckpointError, match=r"must not exist yet, but .*/branch/global_step_4 does\. Give each "
                       r"branch its own dst_dir\."):
        branch_checkpoint(src, tmp_path / "branch", lr=3e-4)
    with pytest.raises(ValueError, match=r"lr must be > 0, but got 0\.0\."):
        branch_checkpoint(src, tmp_path / "other", lr=0.0)
    assert issubclass(VerlCheckpointError, LauncherError)


def test_importing_it_imports_no_torch() -> None:
    code = "import sys, verl_sweep.launchers.verl_checkpoints; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
