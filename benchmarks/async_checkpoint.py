"""Asynchronous against synchronous checkpoint saves, side by side: what a save costs the training steps.

Each setup trains through `deepspeed launch/train.py` (the job as users run it) once per mode and repeat, saving
every few steps: "sync" (today's save), "async" (`"checkpoint": {"async": true}`, its writer at the idle scheduling
policy, the default) and "async-normal" (the writer at normal priority, `"async_writer": "normal"`), the modes in
turn for `--repeats` rounds (interleaved, so all see the same minutes of the machine). From metrics.jsonl (every step
logged):
- a normal step: the median wall time between two step records with no save between them;
- the save step: the wall time between the record of a save step s and that of step s + 1, which holds the save
  of step s (synchronous: every file written and committed; asynchronous: the copy of the states) and step s + 1;
- asynchronous saves also report, per save, the time the step was held (`held_s`, the copy) and the time the
  background write took (`write_s`); the check of the issue: the save step at most 1.1 x a normal step + held_s,
  reported for the first save (which allocates the host buffers the later saves reuse) and the later ones apart;
- the excess of a save interval: the wall time of the steps from s + 1 to the next save over as many normal
  steps (what the save cost in all, the background write's share of the cores included).
The end-of-run save (always committed before the job ends) is not counted.

Setups: "demo" (ds_configs/cpu_demo.json: the tiny preset at TP2 x PP2, 4 ranks) and "smollm2"
(ds_configs/cpu_smollm2_chat.json: SmolLM2-135M's shape at TP3 x PP2, 6 ranks, ZeRO-1, random weights and the
built-in tokenizer with ds_configs/chat_template.jinja: the checkpoint's size is what counts here), on the CPU; "gpu"
on one GPU (launch/gpu_check.sh): ds_configs/gpu_llama2-7b_8gpu.json cut to one device and 8 of Llama 2's layers
(0.54 B parameters, bf16 with fp32 masters, ZeRO-1, torch's AdamW: 7.5 GB a save, copied into pinned buffers), on
generated documents; `--smoke` runs it at a tiny width on the CPU accelerator (to check the script).

    python benchmarks/async_checkpoint.py                          # the CPU setups, 2 repeats
    python benchmarks/async_checkpoint.py --setups demo --repeats 1 --steps 8   # a smoke run
    python benchmarks/async_checkpoint.py --setups gpu --repeats 1  # one GPU
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]
from common import environment_markdown, start_results  # noqa: E402

# name -> (shipped config, ranks, steps, save interval)
SETUPS = {"demo": ("cpu_demo.json", 4, 24, 6), "smollm2": ("cpu_smollm2_chat.json", 6, 10, 3),
          "gpu": ("gpu_llama2-7b_8gpu.json", 1, 30, 10)}
CPU_SETUPS = ("demo", "smollm2")
MODES = {"sync": {"async": False}, "async": {"async": True},  # mode -> its "checkpoint" keys
         "async-normal": {"async": True, "async_writer": "normal"}}
GPU_LAYERS = {"num_hidden_layers": 8}  # Llama 2's width: 0.54 B parameters with the embeddings
SMOKE_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
               "num_key_value_heads": 4}


def one_gpu(raw: dict, tmp: str, smoke: bool) -> None:
    """The "gpu" setup in `raw` (module docstring): one device, 8 layers (`smoke`: SMOKE_SHAPE), 2,048-token
    sequences of generated documents, 2 x 8 micro-batches a step, torch's AdamW (DeepSpeed's fused Adam would build
    for a minute first)."""
    docs = os.path.join(tmp, "docs.jsonl")
    if not os.path.exists(docs):
        with open(docs, "w") as f:
            for i in range(2000):
                f.write(json.dumps({"text": f"Document {i}. " + "the quick brown fox jumps over it " * (40 + i % 50)})
                        + "\n")
    raw.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=8)
    raw["optimizer"]["params"]["torch_adam"] = True
    section = raw["hybrid3d"]
    section.update(tensor_parallel_size=1, pipeline_parallel_size=1)
    section["model"]["config_overrides"] = SMOKE_SHAPE if smoke else GPU_LAYERS
    section["data"] = {"path": docs, "seq_length": 256 if smoke else 2048}


def run_config(setup: str, mode: str, out_dir: str, steps: int, interval: int, smoke: bool = False) -> dict:
    """The shipped config of `setup` for one run: `steps` steps, a save every `interval`, every step logged, no
    evaluation, `mode`'s saves, output under `out_dir`."""
    name = SETUPS[setup][0]
    with open(os.path.join(REPO, "ds_configs", name)) as f:
        raw = json.load(f)
    if setup == "gpu":
        one_gpu(raw, os.path.dirname(out_dir), smoke)
    section = raw["hybrid3d"]
    section["train"].update(steps=steps, log_interval=1, eval_interval=0, output_dir=out_dir, overwrite=True)
    section["data"]["eval_fraction"] = 0.0
    if section["data"].get("format") == "chat":  # the built-in tokenizer has no template; the shipped one does
        section["data"]["chat_template"] = os.path.join(REPO, "ds_configs", "chat_template.jinja")
    raw.pop("scheduler", None)  # its total_num_steps is the shipped run's; a constant rate times the same
    section["checkpoint"] = {"save_interval": interval, "keep_last": 1, **MODES[mode]}
    return raw


def train(setup: str, mode: str, tmp: str, steps: int, interval: int, smoke: bool = False) -> list[dict]:
    """One run through the launcher; its metrics.jsonl records (its checkpoints are deleted: the GPU machine's disk
    holds a few of the "gpu" setup's)."""
    ranks = SETUPS[setup][1]
    out_dir = os.path.join(tmp, f"{setup}-{mode}")
    config = os.path.join(tmp, f"{setup}-{mode}.json")
    with open(config, "w") as f:
        json.dump(run_config(setup, mode, out_dir, steps, interval, smoke), f)
    env = dict(os.environ, PYTHONPATH=REPO)
    if setup in CPU_SETUPS or smoke:
        env["DS_ACCELERATOR"] = "cpu"
    command = ["deepspeed", "--log_level", "error", "--num_gpus", str(ranks), os.path.join(REPO, "launch", "train.py"),
               "--deepspeed_config", config]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {setup} {mode} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(out_dir)
    return records


def figures(records: list[dict], steps: int, interval: int) -> dict:
    """A run's normal step, save steps, held/write times and save-interval excess (module docstring)."""
    stamps = {r["step"]: r["time"] for r in records if "loss" in r}
    saves = [s for s in range(interval, steps, interval)]  # the end-of-run save excluded
    gaps = {s: stamps[s] - stamps[s - 1] for s in range(2, steps + 1)}  # step 1 has no earlier record
    normal = statistics.median(g for s, g in gaps.items() if s - 1 not in saves)
    save_steps = [gaps[s + 1] for s in saves]
    excess = [sum(gaps[k] for k in range(s + 1, min(s + interval, steps) + 1)) - normal * (min(s + interval, steps) - s)
              for s in saves]
    reports = {r["step"]: r for r in records if "checkpoint" in r}
    return dict(normal_s=normal, save_step_s=save_steps, excess_s=excess,
                held_s=[reports[s]["held_s"] for s in saves if s in reports],
                write_s=[reports[s]["write_s"] for s in saves if s in reports],
                copied_bytes=[reports[s]["copied_bytes"] for s in saves if s in reports])


def summarise(runs: list[dict]) -> dict:
    """Medians over repeats and saves of one setup's mode."""
    def pooled(key):
        values = [v for r in runs for v in (r[key] if isinstance(r[key], list) else [r[key]])]
        return statistics.median(values) if values else None
    out = {key: pooled(key) for key in ("normal_s", "save_step_s", "excess_s", "held_s", "write_s", "copied_bytes")}
    if out["held_s"] is not None:  # the bound, per save: save step <= 1.1 x normal + held
        ratios = [[step / (1.1 * r["normal_s"] + held) for step, held in zip(r["save_step_s"], r["held_s"])]
                  for r in runs]
        out["bound_ratio_first_max"] = max(r[0] for r in ratios)
        later = [v for r in ratios for v in r[1:]]
        out["bound_ratio_later_max"] = max(later) if later else None
    return out


def markdown(results: dict, env: dict, command: str) -> str:
    lines = ["# Asynchronous against synchronous checkpoint saves", "", environment_markdown(env, command), "",
             "| setup | mode | normal step s | save step s | held s (copy) | background write s | MiB a rank | "
             "save interval's excess s | save step / (1.1 x normal + held): first save, later saves (max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setup, modes in results.items():
        for mode, s in modes.items():
            def fmt(v, spec=".3f"):
                return "-" if v is None else format(v, spec)
            lines.append(f"| {setup} | {mode} | {fmt(s['normal_s'])} | {fmt(s['save_step_s'])} | {fmt(s['held_s'])} | "
                         f"{fmt(s['write_s'])} | {fmt(s['copied_bytes'] and s['copied_bytes'] / 2**20, '.1f')} | "
                         f"{fmt(s['excess_s'])} | {fmt(s.get('bound_ratio_first_max'), '.2f')}, "
                         f"{fmt(s.get('bound_ratio_later_max'), '.2f')} |")
    return "\n".join(lines + [""])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default=",".join(CPU_SETUPS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default: the setup's)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--smoke", action="store_true", help="the gpu setup at a tiny width on the CPU accelerator")
    args = parser.parse_args(argv)
    setups = args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.exit(2, f"error: --setups: unknown {unknown[0]!r} (one of {', '.join(SETUPS)})\n")
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        parser.exit(2, f"error: --modes: unknown {next(m for m in modes if m not in MODES)!r} "
                       f"(one of {', '.join(MODES)})\n")
    command, out_dir, env = start_results("async_checkpoint.py", argv, args.out)
    raw = {s: {m: [] for m in modes} for s in setups}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for setup in setups:
                steps = args.steps or SETUPS[setup][2]
                interval = SETUPS[setup][3] if args.steps is None else max(2, steps // 4)
                for mode in modes:
                    began = time.perf_counter()
                    run = figures(train(setup, mode, tmp, steps, interval, args.smoke), steps, interval)
                    raw[setup][mode].append(run)
                    print(f"[repeat {repeat + 1}] {setup} {mode}: normal {run['normal_s']:.3f} s, save steps "
                          f"{[round(v, 3) for v in run['save_step_s']]}, held {[round(v, 3) for v in run['held_s']]} "
                          f"({time.perf_counter() - began:.0f} s)", flush=True)
    results = {s: {m: summarise(runs) for m, runs in modes.items()} for s, modes in raw.items()}
    text = markdown(results, env, command)
    with open(os.path.join(out_dir, "async_checkpoint.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "async_checkpoint.json"), "w") as f:
        json.dump({"command": command, "environment": env, "runs": raw, "summary": results}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
