"""How idle a probe's GPUs were, and why, in the source article's terms.

Reads the per-GPU samples a launcher wrote (``gpu_samples.jsonl``: NVML about once a second
on the local launcher, the simulator's model on the sim) and verl's own timing breakdown
(``timing_s/gen``, ``timing_s/update_actor``, …) from the metrics.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from verl_sweep.objectives.metrics import STEP_TIME_KEY, StepMetrics

IDLE_UTIL_PCT = 10.0
#: the method's guard: free GPU memory must stay above this
MIN_FREE_GB = 5.0
#: a PCIe 4.0 x16 link moves about 32 GB/s each way; "busy" is 70% of it (the source)
PCIE_LINK_MBPS = 32_000.0
GENERATION_KEYS = ("timing_s/gen",)
TRAINING_KEYS = ("timing_s/update_actor", "timing_s/update_critic", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values")


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The sample lines of a probe; torn or garbage lines are skipped."""
    samples = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            sample = json.loads(line)
        except ValueError:
            continue
        if isinstance(sample, dict) and isinstance(sample.get("gpus"), list):
            samples.append(sample)
    return samples


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summarise(samples: list[dict[str, Any]], steps: Sequence[StepMetrics] = ()) -> dict[str, Any] | None:
    """Mean utilisation, idle fraction (< 10%), peak memory, least free memory, the memory
    swing rate, the share of step time in generation vs training, and a diagnosis."""
    if not samples:
        return None
    utils = _finite([g.get("util") for s in samples for g in s["gpus"]])
    used = _finite([g.get("mem_used_mb") for s in samples for g in s["gpus"]])
    totals = _finite([g.get("mem_total_mb") for s in samples for g in s["gpus"]])
    free = [t - u for s in samples for g in s["gpus"]
            for t, u in [(g.get("mem_total_mb"), g.get("mem_used_mb"))]
            if isinstance(t, (int, float)) and isinstance(u, (int, float))]
    pcie = _finite([g.get("pcie_mbps") for s in samples for g in s["gpus"]])
    summary: dict[str, Any] = {
        "n_samples": len(samples),
        "mean_util_pct": round(statistics.fmean(utils), 1) if utils else None,
        "idle_fraction": round(sum(u < IDLE_UTIL_PCT for u in utils) / len(utils), 3) if utils else None,
        "peak_mem_gb": round(max(used) / 1024, 2) if used else None,
        "mem_total_gb": round(max(totals) / 1024, 2) if totals else None,
        "min_free_gb": round(min(free) / 1024, 2) if free else None,
        "mean_pcie_mbps": round(statistics.fmean(pcie), 1) if pcie else None,
        "mem_swing_gb_per_s": _memory_swing(samples),
    }
    summary.update(_time_shares(steps))
    summary["diagnosis"] = diagnose(summary)
    return summary


def _memory_swing(samples: list[dict[str, Any]]) -> float | None:
    """Median |Δ memory| per second of the busiest-swinging GPU, in GB/s."""
    by_gpu: dict[Any, list[tuple[float, float]]] = {}
    for s in samples:
        t = s.get("t")
        if not isinstance(t, (int, float)):
            continue
        for g in s["gpus"]:
            if isinstance(g.get("mem_used_mb"), (int, float)):
                by_gpu.setdefault(g.get("index"), []).append((float(t), float(g["mem_used_mb"])))
    rates = []
    for series in by_gpu.values():
        deltas = [abs(m1 - m0) / 1024 / (t1 - t0) for (t0, m0), (t1, m1) in zip(series, series[1:]) if t1 > t0]
        if deltas:
            rates.append(statistics.median(deltas))
    return round(max(rates), 3) if rates else None


def _time_shares(steps: Sequence[StepMetrics]) -> dict[str, Any]:
    total = gen = train = 0.0
    for s in steps:
        step_time = s.data.get(STEP_TIME_KEY)
        if step_time is None or not math.isfinite(step_time):
            continue
        total += step_time
        gen += sum(s.data.get(k) or 0.0 for k in GENERATION_KEYS)
        train += sum(s.data.get(k) or 0.0 for k in TRAINING_KEYS)
    if total <= 0:
        return {}
    return {"generation_share": round(gen / total, 3), "training_share": round(train / total, 3)}


class Finding(NamedTuple):
    """One hardware signal: what it is, what was measured, and what to do (may be empty)."""

    name: str
    measured: str
    advice: str = ""

    def __str__(self) -> str:
        return f"{self.name} ({self.measured})" + (f": {self.advice}" if self.advice else "")


def findings(summary: dict[str, Any]) -> list[Finding]:
    """The source's three hardware signals, and two guards of the method, from a summary."""
    found = []
    util = summary.get("mean_util_pct")
    peak, total = summary.get("peak_mem_gb"), summary.get("mem_total_gb")
    memory_full = peak is not None and total and peak / total > 0.85
    if util is not None and util < 30 and memory_full:
        found.append(Finding("data-loading bottleneck", "utilisation < 30% with memory full"))
    pcie = summary.get("mean_pcie_mbps")
    if util is not None and util > 85 and pcie is not None and pcie > 0.7 * PCIE_LINK_MBPS:
        found.append(Finding("communication-bound", "utilisation > 85% with PCIe > 70%", "lower the ulysses size"))
    swing = summary.get("mem_swing_gb_per_s")
    if swing is not None and swing > 2.0:
        found.append(Finding("dynamic batching not effective", "memory swinging > 2 GB/s"))
    free = summary.get("min_free_gb")
    if free is not None and free < MIN_FREE_GB:
        found.append(Finding("free GPU memory under the guard", f"fell to {free:.1f} GB, < {MIN_FREE_GB:.0f} GB"))
    if not found and util is not None and util < 50:
        found.append(Finding("GPUs busy under half the time", f"mean utilisation {util:.0f}%",
                             "tune the layout (the systems stage: rollout TP, micro-batches, memory share)"))
    return found


def diagnose(summary: dict[str, Any]) -> str:
    """The findings in one line; "balanced" when none fires."""
    return "; ".join(map(str, findings(summary))) or "balanced"
