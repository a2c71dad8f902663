"""Do LocalLauncher's GPU slots hold on a real multi-GPU machine?

Queues ``--n-probes`` (5) stand-in probes on a LocalLauncher with ``--gpus-per-probe`` (2)
GPUs each over every GPU NVML sees (4 → 2 slots). Each probe (this file with ``--probe``)
holds ``--alloc-gb`` GB and runs bf16 matmuls on every GPU it can see for
``--probe-seconds``, and writes ``probe_report.json``: the GPUs torch sees, their PCI bus
ids and the NVML indices those map to. The driver starts a probe as soon as a slot frees.
Prints one row per probe (CUDA_VISIBLE_DEVICES, torch's and NVML's view, peak memory and
mean utilisation from the probe's gpu_samples.jsonl) and the idle gap of each slot.
Exit 0 when every probe succeeded, saw exactly its slot's GPUs, the sampler saw its memory
and load, no two concurrent probes shared a GPU, and no slot sat idle > 2 s with work queued.
Exit 2 with fewer GPUs than one slot. Usage: python scripts/check_gpu_slots.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_sweep.launchers import gpu as gpu_mod  # noqa: E402
from verl_sweep.launchers.base import LauncherError, NoCapacityError, RunSpec, RunStatus  # noqa: E402
from verl_sweep.launchers.local import LocalLauncher  # noqa: E402
from verl_sweep.launchers.run_dir import METRICS_OVERRIDE  # noqa: E402


def probe(argv: list[str]) -> int:
    """The stand-in verl probe: load every visible GPU, report what it saw."""
    overrides = dict(item.lstrip("+").split("=", 1) for item in argv if "=" in item)
    metrics_path = Path(overrides[METRICS_OVERRIDE.lstrip("+")])
    run_dir = metrics_path.parent
    seconds = float(os.environ["PROBE_SECONDS"])
    alloc_gb = float(os.environ["PROBE_ALLOC_GB"])
    import pynvml
    import torch

    pynvml.nvmlInit()
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append({"torch_index": i, **_nvml_index_of(pynvml, props)})
    n = 8192
    work = []
    for i in range(len(devices)):
        dev = torch.device("cuda", i)
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        ballast = torch.empty(max(0, int(alloc_gb * 1024**3) - 6 * n * n), dtype=torch.uint8, device=dev)
        work.append((dev, a, ballast))
    t0 = time.monotonic()
    step = 0
    with open(metrics_path, "wb", buffering=0) as out:
        while time.monotonic() - t0 < seconds:
            for dev, a, _ in work:
                for _ in range(10):
                    a @ a
            for dev, _, _ in work:
                torch.cuda.synchronize(dev)
            step += 1
            line = {"step": step, "data": {"timing_s/step": (time.monotonic() - t0) / step}}
            out.write((json.dumps(line) + "\n").encode())
    report = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "devices": devices,
        "steps": step,
    }
    (run_dir / "probe_report.json").write_text(json.dumps(report))
    return 0


def _nvml_index_of(pynvml: object, props: object) -> dict[str, object]:
    """Map a torch device to its NVML index by UUID, else by PCI bus id (torch versions differ)."""
    nvml: Any = pynvml
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            text = str(uuid)
            handle = nvml.nvmlDeviceGetHandleByUUID((text if text.startswith("GPU-") else f"GPU-{text}").encode())
            return {"uuid": str(uuid), "nvml_index": nvml.nvmlDeviceGetIndex(handle)}
        except nvml.NVMLError:
            pass
    if hasattr(props, "pci_bus_id"):
        bus_id = f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        try:
            handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
            return {"pci_bus_id": bus_id, "nvml_index": nvml.nvmlDeviceGetIndex(handle)}
        except nvml.NVMLError:
            pass
    return {"nvml_index": None}  # shown as a mismatch in the table


def drive(args: argparse.Namespace) -> int:
    n_gpus = gpu_mod.gpu_count()
    if n_gpus < args.gpus_per_probe:
        print(f"needs at least {args.gpus_per_probe} GPUs, but NVML sees {n_gpus}")
        return 2
    root = Path(tempfile.mkdtemp(prefix="gpuslots"))
    launcher = LocalLauncher(
        root,
        gpus_per_probe=args.gpus_per_probe,
        command=[sys.executable, str(Path(__file__).resolve()), "--probe"],
        extra_env={"PROBE_SECONDS": str(args.probe_seconds), "PROBE_ALLOC_GB": str(args.alloc_gb)},
        min_free_gpu_memory_gb=args.alloc_gb + 1,
        clock=time.monotonic,
    )
    print(f"{n_gpus} GPUs, {args.gpus_per_probe} per probe -> {launcher.max_concurrent} slots; {args.n_probes} probes; root {root}")
    queue = [RunSpec(run_id=f"probe-{i}", overrides=("probe.n=1",), n_gpus=args.gpus_per_probe) for i in range(args.n_probes)]
    active: dict[str, tuple] = {}
    rows: dict[str, dict] = {}
    t0 = time.monotonic()
    idle_since: dict[tuple[int, ...], float] = {}
    gaps: dict[tuple[int, ...], list[float]] = {}
    while queue or active:
        while queue and launcher.free_slots() > 0:
            spec = queue.pop(0)
            try:
                handle = launcher.start(spec)
            except NoCapacityError:
                queue.insert(0, spec)
                break
            gpus = launcher.slot_gpus(spec.run_id) or ()
            started = time.monotonic()
            if gpus in idle_since:
                gaps.setdefault(gpus, []).append(started - idle_since.pop(gpus))
            active[spec.run_id] = (handle, gpus)
            rows[spec.run_id] = {"gpus": gpus, "start": started - t0}
        for run_id, (handle, gpus) in list(active.items()):
            state = launcher.poll(handle)
            if state.status.is_finished:
                ended = time.monotonic()
                rows[run_id].update(end=ended - t0, state=state)
                idle_since[gpus] = ended
                del active[run_id]
        time.sleep(0.1)
    overlap_ok = True
    spans = sorted(rows.values(), key=lambda r: r["start"])
    for i, r in enumerate(spans):
        for other in spans[i + 1 :]:
            if other["start"] < r["end"] and set(other["gpus"]) & set(r["gpus"]):
                overlap_ok = False

    print(f"{'probe':9} {'slot GPUs':10} {'CVD':8} {'torch->NVML':14} {'peak MB/GPU':22} {'util %':14} {'start':>6} {'end':>6} state")
    all_ok = overlap_ok
    for run_id, r in rows.items():
        run_dir = root / run_id
        report = json.loads((run_dir / "probe_report.json").read_text()) if (run_dir / "probe_report.json").exists() else {}
        seen_nvml = [d["nvml_index"] for d in report.get("devices", [])]
        samples = [json.loads(x) for x in (run_dir / "gpu_samples.jsonl").read_text().splitlines()] if (run_dir / "gpu_samples.jsonl").exists() else []
        peaks, utils = [], []
        for index in r["gpus"]:
            mem = [g["mem_used_mb"] for s in samples for g in s["gpus"] if g["index"] == index]
            util = [g["util"] for s in samples for g in s["gpus"] if g["index"] == index and g["util"] is not None]
            peaks.append(max(mem, default=0))
            utils.append(statistics.mean(util[1:-1]) if len(util) > 2 else 0)
        ok = (
            r["state"].status is RunStatus.SUCCEEDED
            and seen_nvml == list(r["gpus"])
            and report.get("cuda_visible_devices") == ",".join(map(str, r["gpus"]))
            and all(p >= args.alloc_gb * 1024 * 0.8 for p in peaks)
            and all(u >= 30 for u in utils)
        )
        all_ok &= ok
        print(
            f"{run_id:9} {','.join(map(str, r['gpus'])):10} {report.get('cuda_visible_devices', '?'):8} "
            f"{str(seen_nvml):14} {str([round(p) for p in peaks]):22} {str([round(u) for u in utils]):14} "
            f"{r['start']:6.1f} {r['end']:6.1f} {r['state'].status.value}{'' if ok else '  <-- FAIL ' + r['state'].message[:200]}"
        )
    for gpus, slot_gaps in sorted(gaps.items()):
        print(f"slot {gpus}: idle gaps between probes {[round(g, 2) for g in slot_gaps]} s")
    gap_ok = all(g <= 2.0 for slot_gaps in gaps.values() for g in slot_gaps)
    print(f"{'PASS' if overlap_ok else 'FAIL'}  no GPU shared by two concurrent probes")
    print(f"{'PASS' if gap_ok else 'FAIL'}  no slot idle > 2 s while probes were queued")
    print(f"{'PASS' if all_ok else 'FAIL'}  every probe ran on exactly its slot's GPUs, loaded them, and succeeded")
    return 0 if all_ok and gap_ok else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        return probe(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus-per-probe", type=int, default=2)
    parser.add_argument("--n-probes", type=int, default=5)
    parser.add_argument("--probe-seconds", type=float, default=8.0)
    parser.add_argument("--alloc-gb", type=float, default=4.0)
    args = parser.parse_args()
    try:
        return drive(args)
    except LauncherError as e:
        print(e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
