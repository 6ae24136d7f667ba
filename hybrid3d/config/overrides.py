"""Command-line overrides: `--section.key value` pairs written into the raw JSON config."""

import json
from dataclasses import fields

from hybrid3d.config.ds_keys import key_problem
from hybrid3d.config.sections import SECTION, HybridSection
from hybrid3d.ds_internals.config_keys import launcher_flags
from hybrid3d.errors import ConfigError


def parse_override_args(args: list[str]) -> list[tuple[str, str]]:
    """`--section.key value` pairs (also `--key=value`) from the command line, in order."""
    pairs = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --train.steps 100")
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if name in launcher_flags():  # the runner passed its own flag on because it came after the script
            flag = arg if "=" in arg or i + 1 >= len(args) or args[i + 1].startswith("--") else f"{arg} {args[i + 1]}"
            raise ConfigError(f"{arg} is a flag of the deepspeed launcher, which passes it on to the script when "
                              f"it comes after it: put it before the script (deepspeed {flag} launch/train.py ...)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            key, value = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def apply_overrides(raw: dict, overrides: list[tuple[str, str]]) -> list[str]:
    """Write dotted overrides into the raw config; return one 'key: old -> new' line per change.

    A key whose first part is a field of the hybrid3d section (`train.steps`, `model.preset`,
    `tensor_parallel_size`) goes under "hybrid3d"; `hybrid3d.` may also be spelled out; any
    other key is a DeepSpeed key (`zero_optimization.stage`). Values are JSON when they parse
    as JSON (numbers, true/false, null, objects), else strings.
    """
    hybrid_fields = {f.name for f in fields(HybridSection)}
    log = []
    for key, text in overrides:
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"override --{key} is not a valid dotted key")
        if parts[0] in hybrid_fields:
            parts = [SECTION] + parts
        elif parts[0] != SECTION:
            problem = key_problem(parts)
            if problem:
                raise ConfigError(f"override --{key}: {problem}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override --{key}: {part} is not a JSON object in the config")
            node = child
        old = node.get(parts[-1], "<unset>")
        node[parts[-1]] = value
        log.append(f"{'.'.join(parts)}: {json.dumps(old) if old != '<unset>' else old} -> {json.dumps(value)}")
    return log + _model_choice_wins(raw, [k.split(".") for k, _ in overrides])


# A model source named on the command line replaces the other one the JSON names (they are exclusive), so
# `--model.hf_model DIR` works with a config written for a preset.
_REPLACES = {"hf_model": ("preset",), "preset": ("hf_model", "init_from_hf")}


def _model_choice_wins(raw: dict, keys: list[list[str]]) -> list[str]:
    given = {k[-1] for k in keys if k[:-1] in (["model"], [SECTION, "model"])}
    model = raw.get(SECTION, {}).get("model")
    log = []
    for chosen, replaced in _REPLACES.items():
        if chosen not in given or not isinstance(model, dict) or model.get(chosen) is None:
            continue
        for key in replaced:
            if key not in given and model.get(key) not in (None, False):
                log.append(f"{SECTION}.model.{key}: {json.dumps(model[key])} -> null (replaced by "
                           f"--model.{chosen} from the command line)")
                del model[key]
    return log
