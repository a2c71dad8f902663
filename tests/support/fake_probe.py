"""A stand-in verl probe for launcher tests: takes verl's override list, behaves like verl.

- ``actor_rollout_ref.rollout.name`` must be vllm|sglang|trtllm, else it prints verl's
  "Error executing job with overrides" to stderr and exits 1.
- Runs ``trainer.total_training_steps`` steps (default 5) of ``FAKE_STEP_S`` seconds each,
  appending ``{"step": N, "data": {...}}`` lines to the VERL_FILE_LOGGER_PATH override and
  printing verl-like console lines.
- ``+fake.child=group`` starts a child in its process group; ``+fake.child=detached`` starts
  one in a new session (like a Ray worker that left the group); both sleep forever.
- ``+fake.ignore_sigterm=true`` ignores SIGTERM (the launcher must SIGKILL it).
- ``+fake.worker_error=TEXT`` fails as vLLM's engine start did on the H200: TEXT goes only to a
  Ray worker's log in the private Ray dir (``+ray_kwargs.ray_init._temp_dir``), stderr gets
  verl's "Engine core initialization failed" line, exit 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    overrides = {}
    for item in argv:
        key, _, value = item.partition("=")
        overrides[key.lstrip("+")] = value
    name = overrides.get("actor_rollout_ref.rollout.name")
    if name not in ("vllm", "sglang", "trtllm"):
        print(f"Error executing job with overrides: {argv}", file=sys.stderr)
        print(f"ValueError: rollout.name must be vllm, sglang or trtllm, got {name!r}", file=sys.stderr)
        return 1
    worker_error = overrides.get("fake.worker_error")
    if worker_error:
        logs = os.path.join(overrides["ray_kwargs.ray_init._temp_dir"], "session_2026-12-01_15-44-00", "logs")
        os.makedirs(logs, exist_ok=True)
        os.symlink(os.path.dirname(logs), os.path.join(os.path.dirname(os.path.dirname(logs)), "session_latest"))
        # vLLM's engine workers log their exception to stdout (.out); Ray's own errors go to .err
        log = "worker-5f3a57e5-01000000-20304." + overrides.get("fake.worker_log", "err")
        with open(os.path.join(logs, log), "w") as f:
            f.write("INFO starting\nTraceback (most recent call last):\n  File \"vllm/v1/worker/utils.py\"\n"
                    f"ValueError: {worker_error}\n")
        print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
              file=sys.stderr)
        return 1
    if overrides.get("fake.ignore_sigterm") == "true":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = overrides.get("fake.child")
    sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
    if child == "group":
        subprocess.Popen(sleeper)
    elif child == "detached":
        subprocess.Popen(sleeper, start_new_session=True)
    steps = int(overrides.get("trainer.total_training_steps", "5"))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.02"))
    path = overrides.get("ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH")
    out = open(path, "wb", buffering=0) if path else None
    for step in range(1, steps + 1):
        time.sleep(step_s)
        data = {"critic/score/mean": 0.1 + 0.001 * step, "timing_s/step": step_s}
        if out is not None:
            out.write((json.dumps({"step": step, "data": data}) + "\n").encode())
        print(f"(TaskRunnerV1 pid={os.getpid()}) step:{step} - critic/score/mean:np.float64({data['critic/score/mean']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
