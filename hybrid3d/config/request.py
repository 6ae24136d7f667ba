"""Start-up's first phase, `read`: the DeepSpeed JSON with the command line's overrides applied, as a `RunRequest`.

"auto" values are kept as given (`auto`: the keys left to the planner, config/auto_values.py); the hybrid3d section is
typed at once with each "auto" key at its default (`hybrid`), enough to find the model and the data before the
planner decides the rest (start-up's `resolve`, training/entry.py).
"""

import dataclasses

from hybrid3d.config.auto_values import auto_keys, placeholder_config
from hybrid3d.config.overrides import apply_overrides
from hybrid3d.config.sections import SECTION, HybridSection, parse_hybrid_section, read_json


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """The config as given: `raw` is what <output_dir>/config.json records."""

    raw: dict
    override_log: list  # one line per --section.key override
    auto: list  # the keys left "auto" (config.auto_values.auto_keys), as the config names them
    hybrid: HybridSection  # the section, its "auto" keys at their defaults
    given: frozenset  # the hybrid3d section's keys the config sets (a default left alone is not "given")

    @property
    def partition_set(self) -> bool:
        """Whether hybrid3d.partition_method is given (a resume otherwise keeps its checkpoint's stages)."""
        return "partition_method" in self.given


def read_run(config_path: str, overrides) -> RunRequest:
    """The JSON and the overrides; refusals: the file, a key's value that cannot be read, a section that does not
    parse."""
    raw = read_json(config_path)
    override_log = apply_overrides(raw, overrides)
    return request_from(raw, override_log)


def request_from(raw: dict, override_log: list | None = None) -> RunRequest:
    """The request a loaded config makes (`read_run` without the file: tests, benchmarks)."""
    auto = auto_keys(raw)
    hybrid = parse_hybrid_section(placeholder_config(raw) if auto else raw)
    section = raw.get(SECTION)
    return RunRequest(raw, override_log or [], auto, hybrid, frozenset(section if isinstance(section, dict) else ()))
