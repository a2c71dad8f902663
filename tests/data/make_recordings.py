"""Regenerate the recorded metric streams in this folder (run once; outputs are committed).

The JSONL file is written exactly as verl 0.9.1's ``FileLogger`` writes it (orjson with
numpy serialisation, one line per step, NaN → null); the console log exactly as its
``LocalLogger`` prints (``concat_dict_to_str``: ``pprint.pformat`` of numpy scalars) behind a
Ray ``(TaskRunnerV1 pid=…)`` prefix, interleaved with the other lines a real stdout holds.
Values follow a GRPO run on a small model: a saturating reward, noisy per-step time.
"""

from __future__ import annotations

import numbers
import pprint
from pathlib import Path

import numpy as np
import orjson

HERE = Path(__file__).parent


def concat_dict_to_str(data: dict, step: int) -> str:
    # Same as verl.utils.logger.aggregate_logger.concat_dict_to_str (0.9.1).
    output = [f"step:{step}"]
    for k, v in data.items():
        if isinstance(v, numbers.Number):
            output.append(f"{k}:{pprint.pformat(v)}")
    return " - ".join(output)


def main() -> None:
    rng = np.random.default_rng(2024)
    lines: list[bytes] = []
    console: list[str] = [
        "2025-01-01 00:00:00,000 INFO worker.py:1821 -- Started a local Ray instance.",
        "(TaskRunnerV1 pid=4321) Creating file logger at /runs/t1/metrics.jsonl",
        "(WorkerDict pid=5000) INFO 01-01 00:00:12 [model_runner.py:1110] Loading model weights",
        "(TaskRunnerV1 pid=4321) step:0 - val-core/gsm8k/reward/mean@1:np.float64(0.215)",
    ]
    lines.append(orjson.dumps({"step": 0, "data": {"val-core/gsm8k/reward/mean@1": np.float64(0.215)}},
                              option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    t = 0.0
    for step in range(1, 201):
        dt = float(rng.normal(14.0, 0.8))
        t += dt
        reward = 0.2 + (0.75 - 0.2) / (1 + (900.0 / t) ** 1.3) + rng.normal(0, 0.02)
        grad = float(abs(rng.normal(0.3, 0.08)))
        data = {
            "actor/pg_loss": np.float64(rng.normal(0, 0.01)),
            "actor/kl_loss": np.float64(0.001 * step ** 0.7),
            "actor/ppo_kl": np.float64(abs(rng.normal(0.0005, 0.0002))),
            "actor/grad_norm": np.float64("nan") if step in (57, 58) else np.float64(grad),
            "actor/entropy": np.float64(0.6 - 0.001 * step),
            "actor/lr": 1e-6,
            "critic/score/mean": np.float64(reward),
            "critic/score/max": np.float64(1.0),
            "critic/rewards/mean": np.float64(reward),
            "response_length/mean": np.float64(230 + rng.normal(0, 10)),
            "timing_s/gen": np.float64(dt * 0.55),
            "timing_s/step": np.float64(dt),
            "perf/total_num_tokens": np.int64(int(rng.normal(190000, 5000))),
            "perf/time_per_step": np.float64(dt),
            "perf/throughput": np.float64(190000 / dt / 8),
        }
        lines.append(orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        console.append(f"(TaskRunnerV1 pid=4321) {concat_dict_to_str(data, step)}")
        if step % 25 == 0:
            console.append("(WorkerDict pid=5001) WARN: grad_norm is not finite: nan")
            console.append("Training Progress:  12%|█▏        | 25/200 [05:50<40:50, 14.00s/it]")
    (HERE / "metrics_grpo.jsonl").write_bytes(b"".join(lines))
    (HERE / "console_grpo.log").write_text("\n".join(console) + "\n")


if __name__ == "__main__":
    main()
