"""How often the driver reads a stage study's trial list, per probe started, in one repetition
of the benchmark's demo study (replay launcher; SIMULATED):

    python -m benchmarks.reads [LANDSCAPE [REP]]

Counts every call of Optuna's cached storage's ``get_all_trials`` on a stage study (the root
study's reads aside), with a state filter or without: each one is a query. It counts by
wrapping that method in this process; the driver runs as shipped. Prints one JSON line."""
from __future__ import annotations

import collections
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path

from optuna.storages import _CachedStorage

from benchmarks import methods as M
from benchmarks.run import rep_spec

counts: collections.Counter[str] = collections.Counter()
_original = _CachedStorage.get_all_trials


def counting(self, study_id, deepcopy=True, states=None):  # type: ignore[no-untyped-def]
    """``get_all_trials``, counted when it reads a stage study (``<study>.<stage>``)."""
    name = self._backend.get_study_name_from_id(study_id)
    if "." in name:
        counts["all" if states is None else "filtered"] += 1
    return _original(self, study_id, deepcopy=deepcopy, states=states)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    landscape = sys.argv[1] if len(sys.argv) > 1 else "default"
    rep = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    _CachedStorage.get_all_trials = counting  # type: ignore[method-assign]
    spec = rep_spec(landscape, rep)
    with tempfile.TemporaryDirectory(prefix="vs-reads-") as tmp:
        launcher = M.replay_launcher(Path(tmp), landscape)
        trace = M.run_staged(spec, launcher)
        n = len(launcher.usage())
        launcher.close()
    out = {"landscape": landscape, "rep": rep, "probes": n, "reads_all": counts["all"],
           "reads_filtered": counts["filtered"], "all_per_probe": round(counts["all"] / n, 2),
           "any_per_probe": round((counts["all"] + counts["filtered"]) / n, 2), "gpu_h": round(trace.gpu_h, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
