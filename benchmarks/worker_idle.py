"""Issue 7: how idle are workers at stage boundaries? N workers (processes, the simulator
launcher, one probe each) share one study; each worker's idle time is the part of its life
with no probe running, measured from the database (trial start/end and owner pid).

Usage: python -m benchmarks.worker_idle [--workers 8] [--storage URL]
Prints one row per worker and the total idle fraction. Simulator time is compressed, so the
figure includes process start-up and the machine's scheduling on few cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--storage", default=os.environ.get("VERL_SWEEP_TEST_PG_URL"))
    parser.add_argument("--time-scale", type=float, default=3000.0)
    args = parser.parse_args()
    import optuna

    work = Path(tempfile.mkdtemp(prefix="idle"))
    data = yaml.safe_load((REPO / "studies" / "demo.yaml").read_text())
    name = f"idle{uuid.uuid4().hex[:8]}"
    storage = args.storage or f"sqlite:///{work}/{name}.db"
    data.update(name=name, storage=storage)
    data["launcher"] = {"kind": "sim", "max_concurrent": 1, "options": {"time_scale": args.time_scale}}
    data["probe"] = {"steps": 200, "incumbent_repeats": 2}
    data["stages"] = [{"name": n, "space": k, "budget": {"max_trials": 10}, "confirm_top": 2}
                      for n, k in (("minibatch", "mini_batch"), ("kl", "kl"), ("lr", "lr"))]
    study_file = work / f"{name}.yaml"
    study_file.write_text(yaml.safe_dump(data, sort_keys=False))
    cmd = [sys.executable, "-m", "search.cli"]
    procs = [subprocess.Popen([*cmd, "run", str(study_file)], cwd=work, stdout=subprocess.DEVNULL)]
    time.sleep(3)
    procs += [subprocess.Popen([*cmd, "worker", name, "--storage", storage], cwd=work, stdout=subprocess.DEVNULL)
              for _ in range(args.workers - 1)]
    lives = {}
    for p in procs:
        started = time.time()
        p.wait()
        lives[p.pid] = time.time()
    intervals: dict[int, list[tuple[float, float]]] = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if not summary.study_name.startswith(name + "."):
            continue
        for t in optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False):
            owner = t.user_attrs.get("owner") or {}
            if t.datetime_start and t.datetime_complete and "run_id" in t.user_attrs:
                intervals.setdefault(owner.get("pid"), []).append(
                    (t.datetime_start.timestamp(), t.datetime_complete.timestamp()))
    first = min(s for spans in intervals.values() for s, _ in spans)
    last = max(e for spans in intervals.values() for _, e in spans)
    print(f"{len(procs)} workers, {sum(len(v) for v in intervals.values())} probes, study {last - first:.0f} s")
    print("worker   probes  busy s  idle %")
    total_busy = total = 0.0
    for pid, spans in sorted(intervals.items()):
        busy, end = 0.0, first
        for s, e in sorted(spans):
            s = max(s, end)
            if e > s:
                busy += e - s
                end = e
        total_busy += busy
        total += last - first
        print(f"{pid:<8} {len(spans):>6}  {busy:6.0f}  {100 * (1 - busy / (last - first)):5.1f}")
    print(f"idle fraction of worker time: {100 * (1 - total_busy / total):.1f}%")
    _ = started, lives
    return 0


if __name__ == "__main__":
    sys.exit(main())
