"""`hybrid3d.data.blend`: the entries of a weighted blend of datasets, checked with the config (one line naming the
entry's key)."""

from hybrid3d.errors import ConfigError

KEY = "hybrid3d.data.blend"
ENTRY_KEYS = ("path", "weight", "eval_path")


def check_blend(blend, path) -> None:
    """`blend` (hybrid3d.data.blend): a non-empty list of {"path", "weight"[, "eval_path"]}, weights >= 0, not all 0;
    exclusive with data.path."""
    if blend is None:
        return
    if path is not None:
        raise ConfigError(f"{KEY} and hybrid3d.data.path are exclusive: a blend names its datasets' paths")
    if not isinstance(blend, list) or not blend:
        raise ConfigError(f"{KEY} must be a non-empty list of {{\"path\": ..., \"weight\": ...}}, got {blend!r}")
    for i, entry in enumerate(blend):
        where = f"{KEY}[{i}]"
        if not isinstance(entry, dict) or not entry:
            raise ConfigError(f"{where} must be an object with a path and a weight, got {entry!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]} is not a known key (known: {', '.join(ENTRY_KEYS)})")
        for name in ("path", "weight"):
            if name not in entry:
                raise ConfigError(f"{where}.{name} is missing")
        for name in ("path", "eval_path"):
            if name in entry and (not isinstance(entry[name], str) or not entry[name]):
                raise ConfigError(f"{where}.{name} must be a non-empty string, got {entry[name]!r}")
        weight = entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
            raise ConfigError(f"{where}.weight must be a number >= 0, got {weight!r}")
    if not sum(entry["weight"] for entry in blend) > 0:
        raise ConfigError(f"{KEY}: every weight is 0 (weights are normalised to sum 1: at least one must be > 0)")
