"""Check verl_sweep.launchers.gpu on a real GPU: does NVML see the load a torch workload puts on GPU 0?

Runs ~10 s of bf16 matmuls on GPU 0 holding ~``--alloc-gb`` GB, with a GpuSampler writing
gpu_samples.jsonl, then prints what ``read_gpus`` and the sampler read (free memory and
utilisation before / during / after) next to torch's own ``mem_get_info``.
Exit 0 when: utilisation under load >= 50 %, the sampler's memory rose by >= 80 % of what
torch holds, NVML's free memory agrees with torch's within 1 GB, and it came back after.
Exit 2 when there is no GPU. Usage: python scripts/check_gpu_reading.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_sweep.launchers import gpu as gpu_mod  # noqa: E402
from verl_sweep.launchers.base import LauncherError  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--alloc-gb", type=float, default=8.0)
    parser.add_argument("--index", type=int, default=0, help="NVML index (= CUDA index with CUDA_DEVICE_ORDER=PCI_BUS_ID)")
    args = parser.parse_args()

    if not gpu_mod.has_gpus():
        print("no GPU: NVML found none (check_gpu_reading needs a GPU machine)")
        return 2
    import os

    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import torch

    if not torch.cuda.is_available():
        print("no GPU: torch.cuda.is_available() is False")
        return 2
    device = torch.device("cuda", args.index)
    print(f"GPU {args.index}: {torch.cuda.get_device_name(device)}; NVML sees {gpu_mod.gpu_count()} GPU(s)")

    before = gpu_mod.read_gpus([args.index])[0]
    print(f"before : {fmt(before)}")

    samples_path = Path(tempfile.mkdtemp(prefix="gpuread")) / "gpu_samples.jsonl"
    sampler = gpu_mod.GpuSampler(samples_path, [args.index], clock=time.monotonic, period_s=0.5)
    sampler.start()
    t_start = time.monotonic()

    # Hold alloc_gb: a ballast tensor plus the matmul operands (n x n bf16 = 2 n^2 bytes).
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ballast_bytes = max(0, int(args.alloc_gb * 1024**3) - 3 * 2 * n * n)
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    during: list[gpu_mod.GpuReading] = []
    n_matmuls = 0
    next_read = time.monotonic() + 1.0
    while time.monotonic() - t_start < args.seconds:
        c = a @ b
        n_matmuls += 1
        if n_matmuls % 20 == 0:
            torch.cuda.synchronize(device)
            if time.monotonic() >= next_read:
                during.append(gpu_mod.read_gpus([args.index])[0])
                next_read += 1.0
    torch.cuda.synchronize(device)
    torch_free, torch_total = torch.cuda.mem_get_info(device)
    nvml_now = gpu_mod.read_gpus([args.index])[0]
    held_mb = torch.cuda.memory_reserved(device) / 2**20
    tflops = 2 * n**3 * n_matmuls / (time.monotonic() - t_start) / 1e12
    del a, b, c, ballast
    torch.cuda.empty_cache()
    time.sleep(1.5)
    sampler.stop()
    after = gpu_mod.read_gpus([args.index])[0]

    print(f"load   : {n_matmuls} matmuls {n}x{n} bf16, {tflops:.0f} TFLOP/s, torch holds {held_mb:.0f} MB")
    for i, reading in enumerate(during):
        print(f"during {i:2d}: {fmt(reading)}")
    print(f"after  : {fmt(after)}")
    print(f"torch mem_get_info: free {torch_free / 2**20:.0f} MB of {torch_total / 2**20:.0f} MB; NVML free {nvml_now.mem_free_mb:.0f} MB")

    lines = [json.loads(line) for line in samples_path.read_text().splitlines()]
    utils = [s["gpus"][0]["util"] for s in lines if s["gpus"][0]["util"] is not None]
    used = [s["gpus"][0]["mem_used_mb"] for s in lines]
    print(f"sampler: {len(lines)} lines in {samples_path}; util max {max(utils, default=0):.0f}%, "
          f"mem_used {min(used):.0f} -> {max(used):.0f} MB; first line: {json.dumps(lines[0])}")  # fmt: skip

    load_utils = [r.util_pct for r in during]
    checks = {
        "NVML utilisation under load >= 50%": bool(load_utils) and statistics.median(load_utils) >= 50,
        "sampler saw memory rise by >= 80% of torch's": max(used) - min(used) >= 0.8 * held_mb,
        "NVML free memory agrees with torch within 1 GB": abs(nvml_now.mem_free_mb - torch_free / 2**20) < 1024,
        "memory returned after the workload": after.mem_used_mb < before.mem_used_mb + 1024,
        "sampler wrote >= 1 line per second": len(lines) >= args.seconds,
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


def fmt(r: gpu_mod.GpuReading) -> str:
    pcie = "n/a" if r.pcie_tx_kbps is None else f"tx {r.pcie_tx_kbps / 1024:.1f} / rx {(r.pcie_rx_kbps or 0) / 1024:.1f} MB/s"
    return (f"util {r.util_pct:5.1f}%  used {r.mem_used_mb:8.0f} MB  free {r.mem_free_mb:8.0f} MB  "
            f"total {r.mem_total_mb:8.0f} MB  pcie {pcie}")  # fmt: skip


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LauncherError as e:
        print(e)
        sys.exit(2)
