"""Local and simulator launchers: the shared contract, plus what only they do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support import REPO

from verl_sweep.launchers import LAUNCHERS, make_launcher
from verl_sweep.launchers import gpu as gpu_mod
from verl_sweep.launchers import process as proc_mod
from verl_sweep.launchers.base import LauncherError, RunSpec, RunStatus
from verl_sweep.launchers.local import KV_CACHE_KEY, LocalLauncher, private_ray_dir
from verl_sweep.launchers.run_dir import merge_overrides
from verl_sweep.launchers.sim import SimClock, SimLauncher
from support.launcher_contract import (
    FAKE_PROBE,
    ContractKit,
    LocalGpuLauncherContract,
    leftovers,
    leader_env,
    long_spec,
    ok_spec,
    probe_command,
    running_with_metrics,
    wait_for,
)

FAKE_GPUS = [0, 1, 2, 3]
NO_NVML = not gpu_mod.has_gpus()


def local_launcher(root: Path, **options: object) -> LocalLauncher:
    kwargs: dict[str, object] = {
        "gpu_ids": FAKE_GPUS,
        "gpus_per_probe": 2,
        "command": probe_command(),
        "extra_env": {"VERL_SIM_TIME_SCALE": "5000"},
        "kill_grace_s": 2.0,
    }
    kwargs.update(options)
    return LocalLauncher(root, **kwargs)  # type: ignore[arg-type]


class TestLocalLauncherContract(LocalGpuLauncherContract):
    @pytest.fixture
    def kit(self) -> ContractKit:
        if not NO_NVML:
            pytest.skip("fake GPU ids are only fake on a machine without NVML GPUs")
        return ContractKit(make=local_launcher)


class TestSimLauncherContract(LocalGpuLauncherContract):
    @pytest.fixture
    def kit(self) -> ContractKit:
        def make(root: Path) -> SimLauncher:
            return SimLauncher(root, max_concurrent=2, time_scale=5000.0, gpus_per_probe=2, command=probe_command())

        return ContractKit(make=make)


# -- registry ------------------------------------------------------------------------------


def test_registry_names_and_unknown_kind_lists_valid_ones(tmp_path: Path) -> None:
    assert set(LAUNCHERS) == {"sim", "local", "ray", "replay"}
    with pytest.raises(LauncherError, match=r"launcher kind must be one of local, ray, replay, sim, but got 'slurm'"):
        make_launcher("slurm", tmp_path)
    sim = make_launcher("sim", tmp_path, max_concurrent=3)
    assert isinstance(sim, SimLauncher) and sim.max_concurrent == 3


def test_import_launchers_does_not_import_ray() -> None:
    code = "import sys, launchers; print('ray' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# -- local launcher specifics --------------------------------------------------------------


@pytest.mark.skipif(not NO_NVML, reason="needs a machine without GPUs")
def test_local_launcher_without_gpus_says_so_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match=r"^the local launcher needs GPUs, but NVML found none") as info:
        LocalLauncher(tmp_path)
    assert "\n" not in str(info.value)


def test_bad_slot_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match=r"gpus_per_probe must be <= the number of GPUs \(2\), but got 4"):
        LocalLauncher(tmp_path, gpu_ids=[0, 1], gpus_per_probe=4)
    with pytest.raises(LauncherError, match=r"gpu_ids must not repeat, but got \[0, 0\]"):
        LocalLauncher(tmp_path, gpu_ids=[0, 0])
    launcher = LocalLauncher(tmp_path, gpu_ids=[0, 1, 2, 3, 4], gpus_per_probe=2)
    assert launcher.max_concurrent == 2  # the odd GPU out is never half-used
    with pytest.raises(LauncherError, match=r"n_gpus must be <= gpus_per_probe \(2\), but got 3"):
        launcher.start(RunSpec(run_id="big", overrides=(), n_gpus=3))


def test_pins_are_appended_and_win_over_caller_overrides(tmp_path: Path) -> None:
    launcher = local_launcher(tmp_path)
    spec = RunSpec(run_id="pins", overrides=(*ok_spec("x").overrides, "trainer.save_freq=10", "trainer.logger=[wandb]"))
    handle = launcher.start(spec)
    wait_for(launcher, handle, lambda s: s.status.is_finished, 60)
    argv = json.loads((handle.run_dir / "spec.json").read_text())["argv"]
    tail = argv[len(argv) - 12 :]
    run_dir = handle.run_dir
    wandb_id = tail[8].rpartition("=")[2]
    assert tail == [
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.experiment_name=pins",
        f"hydra.run.dir={run_dir}/hydra",
        "trainer.logger=[console,file,wandb]",  # the caller's loggers kept, with the ones we read
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={run_dir}/metrics.jsonl",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR={run_dir}/tensorboard",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_RUN_ID={wandb_id}",
        "+ray_kwargs.ray_init.address=local",
        f"+ray_kwargs.ray_init._temp_dir={private_ray_dir(run_dir)}",
        "trainer.n_gpus_per_node=2",
    ]
    assert wandb_id.startswith("pins-")
    assert "trainer.save_freq=10" not in argv and "trainer.logger=[wandb]" not in argv
    # Ray's unix socket paths (~60 bytes under the temp dir) must stay below 107 bytes.
    assert len(private_ray_dir(run_dir)) <= 24


def test_merge_overrides_matches_keys_with_plus_prefixes() -> None:
    merged = merge_overrides(["+ray_kwargs.ray_init.address=auto", "a.b=1"], ["++ray_kwargs.ray_init.address=local"])
    assert merged == ["a.b=1", "++ray_kwargs.ray_init.address=local"]


class _H200(LocalLauncher):
    """Fake GPU ids with the H200's total memory (NVML's answer there: 143,771 MiB)."""

    def _gpu_memory_bytes(self, gpus):  # type: ignore[no-untyped-def]
        return 143_771 * 2**20


@pytest.mark.parametrize(
    ("probes_per_gpu", "overrides", "pin"),
    [
        # the tiny study: 4 probes at a memory fraction of 0.1 -> half of 14.4 GB as KV cache
        (4, ("actor_rollout_ref.rollout.gpu_memory_utilization=0.1",), f"+{KV_CACHE_KEY}={int(143_771 * 2**20 * 0.05)}"),
        (2, (), f"+{KV_CACHE_KEY}={int(143_771 * 2**20 * 0.25)}"),  # verl's default fraction 0.5
        (4, (f"+{KV_CACHE_KEY}=1000000000",), f"+{KV_CACHE_KEY}=1000000000"),  # the caller's size wins
        (1, ("actor_rollout_ref.rollout.gpu_memory_utilization=0.1",), None),  # a GPU of its own: vLLM profiles
    ],
)
def test_probes_sharing_a_gpu_get_a_fixed_kv_cache(tmp_path: Path, probes_per_gpu: int, overrides: tuple,
                                                    pin: str | None) -> None:
    launcher = _H200(tmp_path, gpu_ids=[0], probes_per_gpu=probes_per_gpu, command=FAKE_PROBE, kill_grace_s=1.0)
    handle = launcher.start(RunSpec(run_id="kv", overrides=(*long_spec("x").overrides, *overrides)))
    try:
        argv = json.loads((handle.run_dir / "spec.json").read_text())["argv"]
    finally:
        launcher.cancel(handle)
    assert [a for a in argv if KV_CACHE_KEY in a] == ([] if pin is None else [pin])


def test_verl_composes_the_fixed_kv_cache_override() -> None:
    from verl_sweep.verl_knowledge import validate_with_verl

    from verl_sweep.search.spec.study_file import load_study

    config = load_study(REPO / "studies" / "tiny-h200.yaml").baseline_config()
    assert validate_with_verl({**config, f"+{KV_CACHE_KEY}": int(143_771 * 2**20 * 0.05)}) == []
    assert validate_with_verl({**config, KV_CACHE_KEY: 1}) != []  # without "+": not in verl's struct


def _fake_probe_launcher(root: Path) -> LocalLauncher:
    return LocalLauncher(root, gpu_ids=FAKE_GPUS, gpus_per_probe=2, command=FAKE_PROBE, kill_grace_s=1.0)


@pytest.mark.parametrize("child", ["group", "detached"])
def test_cancel_kills_children_that_left_the_group(tmp_path: Path, child: str) -> None:
    launcher = _fake_probe_launcher(tmp_path)
    spec = RunSpec(run_id=f"tree-{child}", overrides=(*long_spec("x").overrides, f"+fake.child={child}", "+fake.ignore_sigterm=true"))
    handle = launcher.start(spec)
    wait_for(launcher, handle, running_with_metrics(handle), 30)
    before = leftovers(handle)
    assert len(before) == 2  # the probe and its sleeping child
    if child == "detached":
        leader = psutil.Process(int(handle.external_id))
        assert any(os.getpgid(p.pid) != leader.pid for p in before)
    launcher.cancel(handle)  # the probe ignores SIGTERM: only SIGKILL after the grace ends it
    assert leftovers(handle) == []
    assert not psutil.pid_exists(int(handle.external_id)) or psutil.Process(int(handle.external_id)).status() == psutil.STATUS_ZOMBIE


def test_kill_leftovers_of_a_dead_driver(tmp_path: Path) -> None:
    # A driver in its own process starts a probe and dies by SIGKILL; the probe lives on.
    code = (
        "import sys, time\n"
        "from verl_sweep.launchers.local import LocalLauncher\n"
        "from verl_sweep.launchers.base import RunSpec\n"
        f"l = LocalLauncher(sys.argv[1], gpu_ids=[0, 1], command={FAKE_PROBE!r})\n"
        "l.start(RunSpec(run_id='orphan', overrides=('actor_rollout_ref.rollout.name=vllm', 'trainer.total_training_steps=100000')))\n"
        "print('started', flush=True); time.sleep(60)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert driver.stdout is not None and driver.stdout.readline().strip() == "started"
    driver.kill()
    driver.wait()
    record = proc_mod.read_record(tmp_path / "orphan")
    assert record is not None and proc_mod.is_alive(record)
    later = _fake_probe_launcher(tmp_path)
    assert later.kill_leftovers() == ["orphan"]
    assert not proc_mod.is_alive(record)
    assert proc_mod.find_marked(record.markers) == []


def test_start_refuses_a_run_that_is_still_running(tmp_path: Path) -> None:
    first = _fake_probe_launcher(tmp_path)
    handle = first.start(long_spec("busy"))
    second = _fake_probe_launcher(tmp_path)
    with pytest.raises(LauncherError, match=r"run 'busy' must not be running already, but pid \d+ still is"):
        second.start(long_spec("busy"))
    first.cancel(handle)


def test_reattach_from_another_driver_process_reports_unknown_exit(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from verl_sweep.launchers.local import LocalLauncher\n"
        "from verl_sweep.launchers.base import RunSpec\n"
        f"l = LocalLauncher(sys.argv[1], gpu_ids=[0, 1], command={FAKE_PROBE!r})\n"
        "l.start(RunSpec(run_id='other', overrides=('actor_rollout_ref.rollout.name=vllm', 'trainer.total_training_steps=25')))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)  # driver exits, probe lives
    launcher = _fake_probe_launcher(tmp_path)
    handle = launcher.reattach("other")
    assert handle is not None
    state, _ = wait_for(launcher, handle, lambda s: s.status.is_finished, 30)
    assert state.status is RunStatus.FAILED and state.exit_code is None
    assert "exit code unknown" in state.message
    assert len(handle.metrics_path.read_text().splitlines()) == 25  # its metrics are all there


# -- simulator launcher specifics ----------------------------------------------------------


def test_sim_clock_reads_scaled_seconds() -> None:
    now = [100.0]
    clock = SimClock(500.0, real_clock=lambda: now[0])
    assert clock() == 0.0
    now[0] = 100.5
    assert clock() == pytest.approx(250.0)


def test_sim_launcher_clock_runs_at_time_scale(tmp_path: Path) -> None:
    launcher = SimLauncher(tmp_path, time_scale=1000.0)
    t0, r0 = launcher.clock(), time.monotonic()
    time.sleep(1.0)  # a busy machine may pause between two reads: 50 ms is 5% of a second
    elapsed_sim, elapsed_real = launcher.clock() - t0, time.monotonic() - r0
    assert elapsed_sim == pytest.approx(1000.0 * elapsed_real, rel=0.05)


def test_sim_launcher_sets_simulator_env_and_fake_gpus(tmp_path: Path) -> None:
    launcher = SimLauncher(tmp_path, max_concurrent=2, time_scale=750.0, landscape="kl_edge", gpus_per_probe=4, command=probe_command())
    handle = launcher.start(long_spec("env-run"))
    wait_for(launcher, handle, running_with_metrics(handle), 30)
    env = leader_env(handle)
    assert env["VERL_SIM_TIME_SCALE"] == "750.0"
    assert env["VERL_SIM_LANDSCAPE"] == "kl_edge"
    assert env["VERL_SIM_GPU_SAMPLES_PATH"] == str(handle.run_dir / "gpu_samples.jsonl")
    assert env["CUDA_VISIBLE_DEVICES"] in ("0,1,2,3", "4,5,6,7")
    assert handle.started_at >= 0.0 and launcher.clock() > handle.started_at
    launcher.cancel(handle)


# -- GPU reading without GPUs --------------------------------------------------------------


@pytest.mark.skipif(not NO_NVML, reason="needs a machine without GPUs")
def test_read_gpus_without_nvml_raises_one_line() -> None:
    assert gpu_mod.has_gpus() is False
    assert gpu_mod.visible_gpu_ids() == []
    with pytest.raises(LauncherError, match=r"NVML must start to read GPUs, but nvmlInit failed|GPU index must be in \[0, 0\)"):
        gpu_mod.read_gpus([0])


def test_gpu_reading_sample_format() -> None:
    reading = gpu_mod.GpuReading(1, 55.0, 1000.0, 81920.0, 80920.0, pcie_tx_kbps=2048.0, pcie_rx_kbps=1024.0)
    assert reading.as_sample() == {
        "index": 1,
        "util": 55.0,
        "mem_used_mb": 1000.0,
        "mem_total_mb": 81920.0,
        "mem_free_mb": 80920.0,
        "pcie_mbps": 3.0,
    }
    assert gpu_mod.GpuReading(0, float("nan"), 0, 0, 0).as_sample()["util"] is None


# -- NVML paths, through a fake pynvml -----------------------------------------------------


class FakeNvml:
    """A stand-in for the pynvml module: devices with fixed memory and utilisation."""

    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    class NVMLError(Exception):
        pass

    def __init__(self, free_gb: list[float], total_gb: float = 80.0) -> None:
        self.free_gb = free_gb
        self.total_gb = total_gb

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.free_gb)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        gib = 1024**3
        free = int(self.free_gb[handle] * gib)
        total = int(self.total_gb * gib)
        return type("Memory", (), {"free": free, "total": total, "used": total - free})()

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> object:
        return type("Util", (), {"gpu": 10 * handle})()

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 2048 if counter == self.NVML_PCIE_UTIL_TX_BYTES else 1024


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml(free_gb=[70.0, 70.0, 3.0, 70.0])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(gpu_mod, "_initialised", False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def test_read_gpus_through_nvml(fake_nvml: FakeNvml) -> None:
    assert gpu_mod.has_gpus() and gpu_mod.gpu_count() == 4
    r0, r1 = gpu_mod.read_gpus([0, 1])
    assert (r0.index, r0.util_pct, r0.mem_free_mb, r0.mem_total_mb) == (0, 0.0, 70 * 1024.0, 80 * 1024.0)
    assert r0.mem_used_mb == pytest.approx(10 * 1024.0)
    assert (r0.pcie_tx_kbps, r0.pcie_rx_kbps) == (2048.0, 1024.0)
    assert (r1.util_pct, r1.pcie_tx_kbps) == (10.0, None)  # unsupported counter: None, not an error
    with pytest.raises(LauncherError, match=r"GPU index must be in \[0, 4\), but got 7"):
        gpu_mod.read_gpus([7])


def test_visible_gpu_ids_follow_cuda_visible_devices(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_mod.visible_gpu_ids() == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert gpu_mod.visible_gpu_ids() == [1, 3]


def test_preflight_refuses_gpus_without_free_memory(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path, gpus_per_probe=2, command=FAKE_PROBE)
    assert launcher.gpu_ids == [0, 1, 2, 3] and launcher.max_concurrent == 2
    first = launcher.start(long_spec("roomy"))  # slot (0, 1): 70 GB free each
    with pytest.raises(LauncherError, match=r"GPU 2 must have at least 5 GB free to start a probe, but has 3\.0 GB free"):
        launcher.start(long_spec("cramped"))  # slot (2, 3)
    assert launcher.free_slots() == 1  # the refused probe did not keep its slot
    assert not (tmp_path / "cramped" / "process.json").exists()
    launcher.cancel(first)
    with pytest.raises(LauncherError, match=r"gpu_ids must be NVML indices in \[0, 4\), but got \[5\]"):
        LocalLauncher(tmp_path, gpu_ids=[0, 5])


def test_sampler_records_the_probes_gpus_while_it_runs(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path, gpu_ids=[0, 1], gpus_per_probe=2, command=FAKE_PROBE, clock=lambda: 42.0)
    handle = launcher.start(ok_spec("sampled", steps=3))
    state, _ = wait_for(launcher, handle, lambda s: s.status.is_finished, 30)
    assert state.status is RunStatus.SUCCEEDED
    lines = [json.loads(x) for x in (handle.run_dir / "gpu_samples.jsonl").read_text().splitlines()]
    assert lines and lines[0]["t"] == 42.0
    assert [g["index"] for g in lines[0]["gpus"]] == [0, 1]
    assert lines[0]["gpus"][0] == {
        "index": 0, "util": 0.0, "mem_used_mb": 10240.0, "mem_total_mb": 81920.0, "mem_free_mb": 71680.0, "pcie_mbps": 3.0,
    }  # fmt: skip
    n = len(lines)
    time.sleep(1.2)
    assert len((handle.run_dir / "gpu_samples.jsonl").read_text().splitlines()) == n  # stopped with the probe


@pytest.mark.parametrize("kind", ["sim", "replay"])
def test_a_study_launcher_gets_the_study_files_max_concurrent(tmp_path: Path, kind: str) -> None:
    from support import demo_data
    from verl_sweep.search.commands.launch import build_launcher
    from verl_sweep.search.spec.study_file import parse_study

    data = demo_data()
    data["launcher"] = {"kind": kind, "max_concurrent": 3, "options": {}}
    launcher = build_launcher(parse_study(data), runs_dir=tmp_path)
    assert launcher.max_concurrent == 3


@pytest.mark.parametrize("log", ["err", "out"])
def test_a_failed_probe_keeps_its_ray_workers_errors_and_is_classified_by_them(tmp_path: Path, log: str) -> None:
    """On the H200, a memory fraction of 1.0 left only "Engine core initialization failed" in
    the probe's stderr; vLLM's reason was in a Ray worker's log in the private Ray dir. The
    launcher keeps those lines, and the probe classifies the failure by them."""
    from verl_sweep.objectives.failures import FailureKind
    from verl_sweep.objectives.probe import Probe, ProbeSettings, ProbeState

    reason = ("Free memory on device cuda:0 (139.42/139.81 GiB) on startup is less than desired GPU memory "
              "utilization (1.0, 139.81 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
    launcher = LocalLauncher(tmp_path, gpu_ids=[0], command=FAKE_PROBE, kill_grace_s=1.0)
    spec = RunSpec(run_id="engine", overrides=(*long_spec("engine").overrides, f"+fake.worker_error={reason}",
                                               f"+fake.worker_log={log}"))
    probe = Probe(launcher, spec, ProbeSettings(steps=5))
    probe.start()
    deadline = time.monotonic() + 30
    while (outcome := probe.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome is not None and outcome.state is ProbeState.FAILED
    assert outcome.failure is FailureKind.OOM, outcome.reason
    assert "less than desired GPU memory utilization" in outcome.reason
    kept = (tmp_path / "engine" / "worker_errors.log").read_text().splitlines()
    assert len(kept) == 2 and kept[0].startswith(f"(worker-5f3a57e5-01000000-20304.{log}) Traceback")  # once, not per link
    shutil.rmtree(private_ray_dir(tmp_path / "engine"))


@pytest.mark.parametrize("kind", ["sim", "replay"])
def test_a_fake_gpu_launcher_gives_a_probe_the_study_nodes_gpus(tmp_path: Path, kind: str) -> None:
    """`--launcher sim` on a 1-GPU study ran its probes on 8 fake GPUs (trainer.n_gpus_per_node=8)."""
    from support import demo_data, write_study
    from verl_sweep.search.commands.launch import launcher_options
    from verl_sweep.search.spec.study_file import load_study

    data = demo_data()
    data["hardware"] = {**data["hardware"], "gpus_per_node": 2}
    data["baseline"] = {**data.get("baseline", {}), "trainer.n_gpus_per_node": 2}
    spec = load_study(write_study(tmp_path, data))
    assert launcher_options(spec, kind)["gpus_per_probe"] == 2
    assert launcher_options(spec.model_copy(update={"launcher": spec.launcher.model_copy(
        update={"options": {"gpus_per_probe": 4}})}), kind)["gpus_per_probe"] == 4  # the study's own wins
