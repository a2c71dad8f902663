#!/usr/bin/env bash
# On a GPU machine: the preflight's GPU reading under a real torch workload, the local
# launcher's slots with stand-in probes, and the per-probe utilisation summary/diagnosis.
# Usage: bash scripts/device_checks.sh OUT_DIR [GPUS_PER_PROBE] [N_PROBES]
set -uo pipefail
out=${1:-out}; per=${2:-1}; n=${3:-3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
nvidia-smi --query-gpu=index,name,memory.total,memory.used,utilization.gpu --format=csv | tee "$out/nvidia_smi.csv"
python3 scripts/check_gpu_reading.py --seconds 10 --alloc-gb 16 2>&1 | tee "$out/gpu_reading.txt"
python3 scripts/check_gpu_slots.py --gpus-per-probe "$per" --n-probes "$n" --probe-seconds 8 --alloc-gb 8 2>&1 | tee "$out/gpu_slots.txt"
python3 - "$out" <<'PY' 2>&1 | tee "$out/utilisation.txt"
import glob, json, sys
from pathlib import Path
from verl_sweep.objectives.utilisation import read_samples, summarise
for path in sorted(glob.glob("/tmp/**/gpu_samples.jsonl", recursive=True)):
    s = summarise(read_samples(Path(path)))
    if s:
        print(path, json.dumps(s))
PY
