"""What a new user trips over (issue 22), the checks that need no process group: a model source named on the
command line, a reused output folder, a single process without the launcher, resume bounds."""

import json

from hybrid3d.config.overrides import apply_overrides
from hybrid3d.config.sections import parse_hybrid_section


def test_hf_model_override_replaces_the_json_preset_and_says_so():
    raw = {"hybrid3d": {"model": {"preset": "tiny"}}}
    log = apply_overrides(raw, [("model.hf_model", "/models/llama")])
    assert raw["hybrid3d"]["model"] == {"hf_model": "/models/llama"}
    assert log == ['hybrid3d.model.hf_model: <unset> -> "/models/llama"',
                   'hybrid3d.model.preset: "tiny" -> null (replaced by --model.hf_model from the command line)']
    parse_hybrid_section(raw)  # no longer "exclusive: set one"


def test_preset_override_replaces_the_json_hf_model():
    raw = {"hybrid3d": {"model": {"hf_model": "/models/llama", "init_from_hf": True}}}
    log = apply_overrides(raw, [("hybrid3d.model.preset", "tiny")])
    assert raw["hybrid3d"]["model"] == {"preset": "tiny"} and len(log) == 3
    parse_hybrid_section(raw)


def test_both_sources_on_the_command_line_are_still_refused():
    import pytest

    from hybrid3d.errors import ConfigError

    raw = {"hybrid3d": {"model": {}}}
    apply_overrides(raw, [("model.hf_model", "/m"), ("model.preset", "tiny")])
    with pytest.raises(ConfigError, match="are exclusive"):
        parse_hybrid_section(json.loads(json.dumps(raw)))
