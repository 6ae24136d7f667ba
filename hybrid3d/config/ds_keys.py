"""Every DeepSpeed key of the JSON (and of a command-line override) checked against the keys DeepSpeed 0.19.8
reads (ds_internals/config_keys.py), with the closest known key suggested.

DeepSpeed ignores a top-level key it does not read, so `gradient_accumulation_step` or `zero_optimisation`
would silently leave a default in force; inside its pydantic sections it fails, but deep in start-up.
"""

import difflib
from dataclasses import fields

from hybrid3d.config.sections import SECTION, HybridSection
from hybrid3d.ds_internals.config_keys import nested_model_keys, section_probe, top_level_keys
from hybrid3d.errors import ConfigError


def _suggest(key: str, known) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def key_problem(path: list[str]) -> str | None:
    """Why a dotted DeepSpeed key (`zero_optimization.stage`) is not one DeepSpeed reads, or None if it is.
    The first part may also be a hybrid3d field: those belong in the "hybrid3d" section."""
    hybrid = {f.name for f in fields(HybridSection)}
    top = top_level_keys()
    first = path[0]
    if first not in top:
        if first in hybrid:
            return f"{first} is a {SECTION} key: put it in the \"{SECTION}\" section"
        return f"{first} is neither a DeepSpeed 0.19.8 key nor a {SECTION} key{_suggest(first, top | hybrid)}"
    known, removed = section_probe(first)
    if removed:
        return f"{first}: {removed}"
    if len(path) < 2 or known is None:
        return None
    if path[1] not in known:
        return f"{first}.{path[1]} is not a key DeepSpeed 0.19.8 reads{_suggest(path[1], known)}"
    nested = nested_model_keys(first, path[1])
    if len(path) > 2 and nested is not None and path[2] not in nested:
        return f"{'.'.join(path[:3])} is not a key DeepSpeed 0.19.8 reads{_suggest(path[2], nested)}"
    return None


def _paths(node: dict, prefix: list[str], depth: int):
    for key, value in node.items():
        yield prefix + [key]
        if isinstance(value, dict) and depth > 1:
            yield from _paths(value, prefix + [key], depth - 1)


def check_deepspeed_keys(ds: dict) -> None:
    """Refuse the first key of the DeepSpeed part of the config (no hybrid3d section) DeepSpeed would not read."""
    for path in _paths(ds, [], 3):
        problem = key_problem(path)
        if problem:
            raise ConfigError(problem)
