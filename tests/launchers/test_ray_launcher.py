"""RayJobLauncher against a real local Ray cluster (started here, with fake GPUs and 2 slots)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from support.launcher_contract import ContractKit, LauncherContract, metric_steps, ok_spec, probe_command, wait_for
from verl_sweep.launchers import process as proc_mod
from verl_sweep.launchers.base import LauncherError, RunStatus
from verl_sweep.launchers.ray_jobs import RayJobLauncher

pytestmark = pytest.mark.slow

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A private head node: every port chosen free and a short temp dir of its own, so it
    neither meets nor stops anyone else's cluster on this machine (hence no ``ray stop``,
    which stops every Ray process of the user: the test kills its own cluster's processes)."""
    temp_dir = tempfile.mkdtemp(prefix="vsr", dir="/tmp")
    gcs, dash, client, node, obj, agent_http, agent_grpc, metrics, rt_env = _free_ports(9)
    env = dict(os.environ)
    # Ray 2.60 turns token auth on by default for new clusters; "disabled" is the mode that
    # turns it off (ray/_private/authentication/authentication_token_setup.py).
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    cmd = [
        RAY, "start", "--head", f"--port={gcs}", "--num-cpus=4", "--num-gpus=4",
        '--resources={"verl_sweep_slot": 2}', "--include-dashboard=true",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={client}", f"--node-manager-port={node}",
        f"--object-manager-port={obj}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={rt_env}", "--disable-usage-stats",
    ]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        _stop_cluster(temp_dir)
        pytest.fail(f"ray start failed: {result.stderr[-2000:]}")
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait_for_job_server(address)
        yield address
    finally:
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old
        _stop_cluster(temp_dir)


def _wait_for_job_server(address: str) -> None:
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + 90
    while True:
        try:
            JobSubmissionClient(address).list_jobs()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _stop_cluster(temp_dir: str) -> None:
    """Kill exactly the processes of this cluster: they all name its temp dir."""
    record = proc_mod.ProcessRecord(pid=-1, create_time=0.0, pgid=-1, argv=(), markers=(temp_dir,))
    proc_mod.kill_tree(record, grace_s=5.0)
    shutil.rmtree(temp_dir, ignore_errors=True)


def ray_launcher(root: Path, address: str, **options: object) -> RayJobLauncher:
    kwargs: dict[str, object] = {
        "address": address,
        "max_concurrent": 2,
        "command": probe_command(),
        "extra_env": {"VERL_SIM_TIME_SCALE": "5000", "RAY_AUTH_MODE": "disabled"},
        "gpus_per_probe": 2,
        "stop_timeout_s": 30.0,
    }
    kwargs.update(options)
    return RayJobLauncher(root, **kwargs)  # type: ignore[arg-type]


class TestRayJobLauncherContract(LauncherContract):
    @pytest.fixture
    def kit(self, ray_address: str) -> ContractKit:
        return ContractKit(make=lambda root: ray_launcher(root, ray_address), queues=True, timeout_s=90)


def test_start_again_reattaches_instead_of_rerunning(ray_address: str, tmp_path: Path) -> None:
    from ray.job_submission import JobSubmissionClient

    first = ray_launcher(tmp_path, ray_address)
    spec = ok_spec("idem-run", steps=30)
    handle = first.start(spec)
    second = ray_launcher(tmp_path, ray_address)
    again = second.start(spec)  # Ray refuses the id: the launcher follows the existing job
    assert again.external_id == handle.external_id == "idem-run"
    state, _ = wait_for(second, again, lambda s: s.status.is_finished, 90)
    assert state.status is RunStatus.SUCCEEDED and state.exit_code == 0
    assert metric_steps(again) == list(range(1, 31))
    client = JobSubmissionClient(ray_address)
    jobs = [j for j in client.list_jobs() if j.submission_id == "idem-run"]
    assert len(jobs) == 1
    info = client.get_job_info("idem-run")
    # (The job server does not report entrypoint_resources back; the contract's third probe
    # waiting as PENDING on two slots is what proves the slot resource is asked for.)
    assert "trainer.experiment_name=idem-run" in info.entrypoint
    assert info.metadata["verl_sweep_run_id"] == "idem-run"
    assert "step:30" in again.stdout_path.read_text()  # the job log, mirrored for the parser


def test_unreachable_cluster_is_a_launcher_error(tmp_path: Path) -> None:
    (port,) = _free_ports(1)
    launcher = ray_launcher(tmp_path, f"http://127.0.0.1:{port}")
    with pytest.raises(LauncherError, match=r"the Ray job server must be reachable at http://127\.0\.0\.1:\d+, but"):
        launcher.start(ok_spec("nowhere"))


def test_driver_killed_while_jobs_run_reattaches_on_resume(ray_address: str, tmp_path: Path) -> None:
    """SIGKILL the driver while its Ray jobs run; `resume` follows the same jobs (same
    submission ids, not submitted again) and tells their results to Optuna."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import optuna
    from ray.job_submission import JobSubmissionClient

    from support import cli, demo_data, write_study
    from verl_sweep.search.database.storage import open_storage
    from verl_sweep.search.spec.errors import BadInputError

    data = demo_data()
    data["name"] = "rayre"
    data["launcher"] = {"kind": "ray", "max_concurrent": 2, "options": {
        "address": ray_address, "command": probe_command(), "gpus_per_probe": 2, "stop_timeout_s": 30.0,
        "extra_env": {"VERL_SIM_TIME_SCALE": "1500", "RAY_AUTH_MODE": "disabled"}}}
    data["probe"] = {"steps": 60, "incumbent_repeats": 2}
    data["stages"] = [{"name": "lr", "space": "lr", "budget": {"max_trials": 3}, "confirm_top": 0,
                       "pruner": {"name": "none"}}]
    data["final_check"] = False  # the re-attach is the subject: six more Ray jobs would prove nothing here
    study = write_study(tmp_path, data, "rayre.yaml")
    url = f"sqlite:///{tmp_path}/rayre.db"
    log = tmp_path / "driver.log"
    with log.open("wb") as out:
        driver = subprocess.Popen([sys.executable, "-m", "verl_sweep.search.commands.cli", "run", str(study)], cwd=tmp_path,
                                  stdout=out, stderr=subprocess.STDOUT)
    running: list[str] = []
    # Generous: on CI's two cores beside the worker fault tests, each Ray job's start is slow.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(running) < 2 and driver.poll() is None:
        time.sleep(0.5)
        try:  # read only: a poller that created the schema would race the driver's own first look
            trials = optuna.load_study(study_name="rayre.lr", storage=open_storage(url, create=False, readonly=True)
                                       ).get_trials(deepcopy=False)
        except (KeyError, BadInputError):  # the database or the stage's study does not exist yet
            continue
        running = [t.user_attrs["run_id"] for t in trials if t.state.name == "RUNNING" and "run_id" in t.user_attrs]
    assert len(running) >= 2, f"the driver never had two jobs running; its output:\n{log.read_text()[-3000:]}"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=10)
    client = JobSubmissionClient(ray_address)
    assert all(client.get_job_status(run_id) is not None for run_id in running)

    result = cli("resume", "rayre", "--storage", url, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "re-attached to the runs of trial(s)" in result.stdout
    trials = {t.user_attrs.get("run_id"): t for t in
              optuna.load_study(study_name="rayre.lr", storage=url).get_trials(deepcopy=False)}
    for run_id in running:
        assert trials[run_id].state.name == "COMPLETE", run_id  # the same trial, told after re-attaching
    submitted = [job.submission_id for job in client.list_jobs() if job.submission_id.startswith("rayre.")]
    assert len(submitted) == len(set(submitted)), "a job was submitted twice"
