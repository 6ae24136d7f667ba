"""Per-step training metrics: the console line, metrics.jsonl, and DeepSpeed's monitors."""

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Optional

from deepspeed.accelerator import get_accelerator


def peak_memory_bytes() -> int:
    """Peak allocated accelerator memory, or the process's peak RSS on the CPU."""
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return int(accelerator.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class MetricsLogger:
    """Rank 0 prints one line per `log_interval` steps and appends the same record to metrics.jsonl.

    Throughput: tokens/s = B * s / step time. Model FLOPs (Narayanan et al. 2021, no recompute):
    TFLOP/s per device = flops_per_token * tokens/s / world_size; MFU = that / peak_tflops.
    """

    def __init__(self, output_dir: str, total_steps: int, tokens_per_step: int, world_size: int,
                 flops_per_token: float, peak_tflops: Optional[float], enabled: bool, monitor=None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.enabled = enabled
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.step_times = []

    def record(self, step: int, loss: float, lr: float, grad_norm: Optional[float], step_time: float,
               eval_loss: Optional[float] = None, log: bool = True, extra: Optional[dict] = None,
               echo: bool = True, eval_losses: Optional[dict] = None) -> dict:
        """`extra`: further fields of the record (a MoE model's `aux_loss`, `expert_load`, `expert_load_max`);
        `echo`: print the logged record's console line too; `eval_losses`: a blend's eval loss per dataset."""
        self.step_times.append(step_time)
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else float("nan")
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "memory_bytes": peak_memory_bytes(),
            "time": time.time(),
            **(extra or {}),
        }
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
            record["eval_perplexity"] = math.exp(min(eval_loss, 50.0))
        if eval_losses:
            record["eval_losses"] = dict(eval_losses)
        if self.enabled and log:
            self._write(record)
            if echo:
                print(self._line(record), flush=True)
        return record

    def checkpoint(self, report: dict) -> None:
        """An asynchronous save's record in metrics.jsonl (`checkpoint`, `step`, `held_s`, `write_s`,
        `copied_bytes`), on a line of its own: its lines have no `loss`."""
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps({**report, "time": time.time()}) + "\n")

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.monitor is not None:
            samples = record["step"]
            events = [(f"Train/hybrid3d/{k}", record[k], samples) for k in
                      ("loss", "lr", "tokens_per_s", "tflops") if record[k] is not None]
            events += [(f"Train/hybrid3d/{k}", record[k], samples) for k in ("aux_loss", "expert_load_max")
                       if k in record]
            if "eval_loss" in record:
                events.append(("Eval/hybrid3d/loss", record["eval_loss"], samples))
            events += [(f"Eval/hybrid3d/loss/{name}", loss, samples)
                       for name, loss in record.get("eval_losses", {}).items()]
            self.monitor.write_events(events)

    def _line(self, r: dict) -> str:
        recent = self.step_times[-20:]
        eta = (self.total_steps - r["step"]) * sorted(recent)[len(recent) // 2]
        parts = [
            f"step {r['step']}/{self.total_steps}",
            f"loss {r['loss']:.4f}",
            f"lr {r['lr']:.3e}",
            f"grad norm {r['grad_norm']:.3f}" if r["grad_norm"] is not None else "grad norm n/a",
            f"{r['tokens_per_s']:,.0f} tok/s",
            f"{r['tflops']:.3f} TFLOP/s",
            f"MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else "MFU n/a",
            f"mem {r['memory_bytes'] / 2**30:.2f} GiB",
            f"ETA {_duration(eta)}",
        ]
        if "aux_loss" in r:
            parts.insert(2, f"aux {r['aux_loss']:.4f} (busiest expert {r['expert_load_max']:.2f}x even)")
        if "eval_loss" in r:
            per_dataset = "".join(f", {name} {loss:.4f}" for name, loss in r.get("eval_losses", {}).items())
            parts.insert(2, f"eval loss {r['eval_loss']:.4f} (ppl {r['eval_perplexity']:.1f}{per_dataset})")
        return " | ".join(parts)


def info(message: str, enabled: bool = True) -> None:
    if enabled:
        print(message, file=sys.stdout, flush=True)
