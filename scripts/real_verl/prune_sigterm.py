"""On the GPU: a one-stage study whose candidate must be pruned, nvidia-smi around the prune,
then SIGTERM to its driver with nvidia-smi and the process table around the tear-down.

The study is the tiny study with one lr stage far below the toy's working lr (1e-6 to 3e-6
against the incumbent's 1e-4): the candidate learns nothing, so the incumbent pruner stops it
a few steps after its warm-up while the two incumbent runs go on holding GPU memory; then the
driver gets SIGTERM, as a Ctrl-C or a cluster's pre-emption would send.

usage: python scripts/real_verl/prune_sigterm.py TINY_STUDY.yaml WORKDIR EVIDENCE_DIR [LAUNCHER]
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

NAME = "tiny-h200-prune"
MARKER_ENV = "VERL_SWEEP_RUN_DIR"  # verl_sweep.launchers.process.MARKER_ENV
PRUNED = re.compile(r"pruned at step \d+")
CALIBRATED_WORLD = Path(__file__).with_name("tiny_h200.landscape.yaml")
NO_PRUNE_AFTER_S = float(os.environ.get("SIGTERM_AFTER_S", "480"))  # SIGTERM then, pruned or not


def derive_study(base: Path, workdir: Path, launcher: str | None) -> Path:
    spec = yaml.safe_load(base.read_text())
    spec["name"] = NAME
    if launcher == "sim":  # a dry run on CPU, in the world calibrated to the real tiny runs
        spec["launcher"] = {"kind": "sim", "options": {"landscape": str(CALIBRATED_WORLD), "time_scale": 20}}
        # the simulator does not share a GPU between probes, so their memory-fraction bound is not shared
        spec["unsafe_baseline"] = [*spec.get("unsafe_baseline", []), "actor_rollout_ref.rollout.gpu_memory_utilization"]
    # The running rate needs MIN_SCORED_STEPS steps after the warm-up before a prune can act.
    spec["probe"]["steps"] = int(os.environ.get("PRUNE_PROBE_STEPS", spec["probe"]["steps"]))
    spec["stages"] = [{
        "name": "lr", "space": "lr", "params": {"low": 1.0e-6, "high": 3.0e-6},
        "budget": {"max_trials": 3}, "pruner": {"interval_steps": 1, "warmup_steps": 3,
                   "patience": int(os.environ.get("PRUNE_PATIENCE", "2"))},
    }]
    path = workdir / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def smi() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=timestamp,memory.used,memory.total,utilization.gpu",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:  # a dry run of this script off the GPU machine
        return "no nvidia-smi here"
    return gpu + ("\n" + apps if apps else "")


def processes(run_root: Path) -> list[dict[str, Any]]:
    """Live processes of this study's runs (by their marker) and every Ray process."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            marker = p.environ().get(MARKER_ENV, "")
        except psutil.Error:
            marker = ""
        name = p.info["name"] or ""
        cmd = " ".join(p.info["cmdline"] or [])
        ours = marker.startswith(str(run_root))
        if ours or name.startswith("ray::") or "raylet" in cmd or "gcs_server" in cmd:
            found.append({"pid": p.info["pid"], "status": p.info["status"], "name": name, "ours": ours,
                          "run": marker.rsplit("/", 1)[-1] or "-", "cmd": cmd[:100]})
    return found


def snapshot(label: str, t0: float, run_root: Path) -> dict[str, Any]:
    procs = processes(run_root)
    return {"label": label, "t": round(time.time(), 2), "since_start_s": round(time.time() - t0, 1),
            "nvidia_smi": smi(), "our_processes": sum(p["ours"] for p in procs),
            "our_processes_alive": sum(p["ours"] and p["status"] != "zombie" for p in procs),
            "processes": procs}


def main() -> None:
    base, workdir, evidence = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    workdir.mkdir(parents=True, exist_ok=True)
    evidence.mkdir(parents=True, exist_ok=True)
    launcher_kind = sys.argv[4] if len(sys.argv) > 4 else None  # sim: a dry run here
    study = derive_study(base, workdir, launcher_kind)
    run_root = workdir / "runs" / NAME
    log = workdir / "driver.log"
    code = 'import sys; sys.argv[0] = "verl-sweep"; from verl_sweep.search.commands.cli import main; main()'
    t0 = time.time()
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-c", code, "run", str(study), "--storage",
                                   f"sqlite:///{workdir / NAME}.db"], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    shots: list[dict[str, Any]] = []
    # The prune is logged after its run is torn down: keep the seconds before it too.
    recent: collections.deque[dict[str, Any]] = collections.deque([snapshot("start", t0, run_root)], maxlen=8)
    pruned_line = None
    while time.time() - t0 < NO_PRUNE_AFTER_S and driver.poll() is None:
        time.sleep(1.0)
        match = PRUNED.search(log.read_text(errors="replace"))
        if match:
            pruned_line = next(line for line in log.read_text(errors="replace").splitlines() if PRUNED.search(line))
            shots.extend({**shot, "label": f"{round(time.time() - shot['t'])} s before the prune was logged"}
                         for shot in recent)
            seen = time.time()
            for wait in (0, 3, 6, 10):
                time.sleep(max(0.0, seen + wait - time.time()))
                shots.append(snapshot(f"{wait} s after the prune was logged", t0, run_root))
            break
        recent.append(snapshot("poll", t0, run_root))
    shots.append(snapshot("just before SIGTERM to the driver", t0, run_root))
    term_at = time.time()
    driver.send_signal(signal.SIGTERM)
    exited_after = None
    for second in range(1, 31):
        time.sleep(1.0)
        if exited_after is None and driver.poll() is not None:
            exited_after = round(time.time() - term_at, 1)
        if second in (1, 3, 5, 10, 20, 30) or (exited_after is not None and second == int(exited_after) + 1):
            shots.append(snapshot(f"{second} s after SIGTERM", t0, run_root))
    if driver.poll() is None:
        driver.kill()
    result = {"study": str(study), "pruned": pruned_line, "driver_exit_code": driver.wait(),
              "driver_exit_s_after_sigterm": exited_after, "snapshots": shots}
    (evidence / "prune-sigterm.json").write_text(json.dumps(result, indent=1))
    with open(evidence / "prune-sigterm.txt", "w") as txt:
        txt.write(f"prune: {pruned_line}\ndriver exit {result['driver_exit_code']} "
                  f"{exited_after} s after SIGTERM\n")
        for shot in shots:
            txt.write(f"\n# {shot['label']} (t+{shot['since_start_s']} s): "
                      f"{shot['our_processes_alive']} live process(es) of this study's runs, "
                      f"{shot['our_processes']} incl. zombies\n{shot['nvidia_smi']}\n")
    print(open(evidence / "prune-sigterm.txt").read(), flush=True)


if __name__ == "__main__":
    main()
