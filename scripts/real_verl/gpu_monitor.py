"""Sample the GPU every second: memory in use on the card, and per probe (compute processes
mapped to the run directory their environment carries). Writes one JSON line a sample.

usage: python scripts/real_verl/gpu_monitor.py OUT.jsonl   (runs until killed)
"""

from __future__ import annotations

import json
import sys
import time

import psutil
import pynvml

MARKER_ENV = "VERL_SWEEP_RUN_DIR"  # verl_sweep.launchers.process.MARKER_ENV


def run_of(pid: int) -> str:
    try:
        return psutil.Process(pid).environ().get(MARKER_ENV, "?").rsplit("/", 1)[-1]
    except psutil.Error:
        return "?"


def main() -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with open(sys.argv[1], "a") as out:
        while True:
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            per_run: dict[str, float] = {}
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                run = run_of(proc.pid)
                per_run[run] = per_run.get(run, 0.0) + (proc.usedGpuMemory or 0) / 2**20
            util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            n_ray = sum(1 for p in psutil.process_iter(["name", "cmdline"])
                        if (p.info["name"] or "").startswith("ray::") or "raylet" in " ".join(p.info["cmdline"] or []))
            out.write(json.dumps({"t": round(time.time(), 2), "used_mib": mem.used // 2**20, "util": util,
                                  "per_run_mib": {k: round(v) for k, v in per_run.items()}, "ray_procs": n_ray}) + "\n")
            out.flush()
            time.sleep(1.0)


if __name__ == "__main__":
    main()
