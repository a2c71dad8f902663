"""Read GPUs through NVML (pynvml from nvidia-ml-py), and sample them while a probe runs.

Contract:
- ``has_gpus()`` is False (never raises) when pynvml is missing, NVML cannot start, or it
  sees no device.
- ``read_gpus(indices)`` returns one ``GpuReading`` per NVML index; raises ``LauncherError``
  when NVML is unusable or an index does not exist.
- ``GpuSampler`` appends one JSON line per period to a file in the format the simulator
  writes: ``{"t": <clock s>, "gpus": [{"index", "util", "mem_used_mb", "mem_total_mb",
  "mem_free_mb", "pcie_mbps"}]}``.

NVML numbers devices in PCI bus order; a probe's CUDA_VISIBLE_DEVICES means the same
devices only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (LocalLauncher sets it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from verl_sweep.launchers.base import Clock, LauncherError

logger = logging.getLogger(__name__)

_MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class GpuReading:
    index: int
    util_pct: float
    mem_used_mb: float
    mem_total_mb: float
    mem_free_mb: float
    pcie_tx_kbps: float | None = None
    pcie_rx_kbps: float | None = None

    def as_sample(self) -> dict[str, Any]:
        """The per-GPU entry of a ``gpu_samples.jsonl`` line (PCIe as MB/s, tx + rx)."""
        pcie_mbps = None
        if self.pcie_tx_kbps is not None or self.pcie_rx_kbps is not None:
            pcie_mbps = ((self.pcie_tx_kbps or 0.0) + (self.pcie_rx_kbps or 0.0)) / 1024.0
        return {
            "index": self.index,
            "util": None if self.util_pct != self.util_pct else self.util_pct,  # NaN -> null
            "mem_used_mb": round(self.mem_used_mb, 1),
            "mem_total_mb": round(self.mem_total_mb, 1),
            "mem_free_mb": round(self.mem_free_mb, 1),
            "pcie_mbps": None if pcie_mbps is None else round(pcie_mbps, 2),
        }


_init_lock = threading.Lock()
_initialised = False


def _nvml() -> Any:
    """The pynvml module, initialised once per process; raises LauncherError if unusable."""
    global _initialised
    try:
        import pynvml
    except ImportError as e:
        raise LauncherError(
            "reading GPUs needs pynvml, but it is not installed. Install nvidia-ml-py "
            "(pip install 'verl-sweep[gpu]')."
        ) from e
    with _init_lock:
        if not _initialised:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                raise LauncherError(
                    f"NVML must start to read GPUs, but nvmlInit failed: {e}. "
                    "Check the NVIDIA driver (nvidia-smi)."
                ) from e
            _initialised = True
    return pynvml


def gpu_count() -> int:
    """Number of GPUs NVML sees; 0 when there is no usable NVML."""
    try:
        nvml = _nvml()
        return int(nvml.nvmlDeviceGetCount())
    except LauncherError:
        return 0
    except Exception as e:  # pynvml.NVMLError and friends: no GPU to speak of
        logger.debug("NVML device count failed: %s", e)
        return 0


def has_gpus() -> bool:
    return gpu_count() > 0


def read_gpus(indices: Sequence[int]) -> list[GpuReading]:
    """One reading per NVML index (utilisation %, memory MB, PCIe KB/s or None)."""
    nvml = _nvml()
    count = int(nvml.nvmlDeviceGetCount())
    readings = []
    for index in indices:
        if not 0 <= index < count:
            raise LauncherError(
                f"GPU index must be in [0, {count}), but got {index}. Use the indices nvidia-smi lists."
            )
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:
            util = float("nan")  # some virtualised GPUs (MIG) do not report it
        readings.append(
            GpuReading(
                index=index,
                util_pct=util,
                mem_used_mb=memory.used / _MB,
                mem_total_mb=memory.total / _MB,
                mem_free_mb=memory.free / _MB,
                pcie_tx_kbps=_pcie(nvml, handle, nvml.NVML_PCIE_UTIL_TX_BYTES),
                pcie_rx_kbps=_pcie(nvml, handle, nvml.NVML_PCIE_UTIL_RX_BYTES),
            )
        )
    return readings


def _pcie(nvml: Any, handle: Any, counter: int) -> float | None:
    try:
        return float(nvml.nvmlDeviceGetPcieThroughput(handle, counter))
    except Exception:  # not supported on every board / driver
        return None


def visible_gpu_ids() -> list[int]:
    """The GPU indices this driver may hand out: CUDA_VISIBLE_DEVICES if it lists integers,
    else every device NVML sees."""
    import os

    count = gpu_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        try:
            ids = [int(x) for x in listed.split(",") if x.strip()]
        except ValueError:
            ids = []  # UUIDs: fall back to NVML's list
        if ids:
            return [i for i in ids if i < count]
    return list(range(count))


class GpuSampler:
    """Appends a reading of ``indices`` to ``path`` every ``period_s`` on a daemon thread.

    Started and stopped by LocalLauncher around a probe; ``stop`` joins the thread. A failing
    read is logged once and sampling stops (it never takes the probe down).
    """

    def __init__(
        self,
        path: Path,
        indices: Sequence[int],
        *,
        clock: Clock = time.time,
        period_s: float = 1.0,
    ) -> None:
        self.path = Path(path)
        self.indices = list(indices)
        self.clock = clock
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.n_samples = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"gpu-sampler:{self.path.parent.name}", daemon=True)
        self._thread.start()

    def sample_once(self) -> dict[str, Any]:
        readings = read_gpus(self.indices)
        line = {"t": self.clock(), "gpus": [r.as_sample() for r in readings]}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.n_samples += 1
        return line

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as e:
                logger.warning("GPU sampling for %s stopped: %s", self.path, e)
                return
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
