"""The DeepSpeed JSON keys DeepSpeed 0.19.8 reads, taken from DeepSpeed itself at run time.

DeepSpeed ignores a top-level key it does not read (`gradient_accumulation_step`, `zero_optimisation`), so a
typo silently falls back to a default. Its key set is not published anywhere, so it is measured here:

- top level and plain-dict sections: `DeepSpeedConfig` parses a dict that records every key looked up in it
  (a second parse per section present in the user's config records that section's keys);
- sections DeepSpeed hands to its pydantic models (`zero_optimization`, `bf16`, the monitors, ...): the
  models' fields and aliases, nested models included;
- sections read outside `DeepSpeedConfig` (`optimizer`/`scheduler` tested with `.keys()`, the pipeline engine's,
  activation checkpointing's, the flops profiler's, aio's): their key constants.

A key DeepSpeed 0.19 removed raises `DeepSpeedConfigError` when parsed; that message is kept and reported.
"""

import functools
import typing

# A batch DeepSpeedConfig accepts without a process group (train = micro x GAS x world size 1).
_BATCH = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


class _RecordingDict(dict):
    """A dict that records the keys looked up in it (`get`, `[]`, `in`) into `seen` as paths."""

    def __init__(self, seen: set, path: tuple, *args):
        super().__init__(*args)
        self.seen, self.path = seen, path

    def get(self, key, *default):
        self.seen.add(self.path + (key,))
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(self.path + (key,))
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(self.path + (key,))
        return super().__contains__(key)


class _OneReplica:
    """The `mpu` of the probe: one data-parallel rank, so `_BATCH` holds whether or not a process group exists
    (DeepSpeedConfig's batch arithmetic otherwise takes the world size from `deepspeed.comm`)."""

    @staticmethod
    def get_data_parallel_world_size() -> int:
        return 1


def _parse(config: dict) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(config, mpu=_OneReplica())


def _constants(module, prefix: str) -> set:
    """The key strings a DeepSpeed constants module names `PREFIX_*` (not its defaults or help texts)."""
    return {value for name, value in vars(module).items()
            if name.startswith(prefix) and isinstance(value, str) and value.isidentifier()
            and not name.endswith(("_DEFAULT", "_FORMAT"))}


def _model_keys(model) -> dict:
    """{key: nested model or None} of a pydantic config model: field names and their aliases."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    keys = {}
    for name, info in model.model_fields.items():
        nested = None
        for candidate in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, DeepSpeedConfigModel):
                nested = candidate
        for key in filter(None, (name, info.alias)):
            keys[key] = nested
    return keys


@functools.lru_cache(maxsize=None)
def _model_sections() -> dict:
    """Top-level sections DeepSpeed parses with a pydantic model (`extra="forbid"`: DeepSpeed itself fails
    on an unknown key there, with a validation traceback deep in `deepspeed.initialize`)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    sections = {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config,
                "bfloat16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config, "comms_logger": CommsLoggerConfig,
                "compile": CompileConfig, "hybrid_engine": HybridEngineConfig, "tensor_parallel": TPTrainingConfig}
    sections.update({k: m for k, m in _model_keys(DeepSpeedMonitorConfig).items() if m is not None})
    return sections


@functools.lru_cache(maxsize=None)
def _other_sections() -> dict:
    """Sections read outside `DeepSpeedConfig.__init__`, with their keys (None: passed on unchecked, e.g. an
    optimizer's own parameters)."""
    from deepspeed.profiling import constants as profiling
    from deepspeed.runtime import constants as runtime
    from deepspeed.runtime.activation_checkpointing import config as act
    from deepspeed.runtime.config import get_pipeline_config
    from deepspeed.runtime.swap_tensor import constants as swap

    pipeline = set(get_pipeline_config({})) | {"use_reentrant"}  # use_reentrant: runtime/pipe/engine.py:210-216
    return {runtime.OPTIMIZER: {runtime.TYPE, runtime.OPTIMIZER_PARAMS, runtime.LEGACY_FUSION},
            runtime.SCHEDULER: {runtime.TYPE, runtime.SCHEDULER_PARAMS},
            "pipeline": pipeline,
            act.ACT_CHKPT: _constants(act, "ACT_CHKPT_"),
            profiling.FLOPS_PROFILER: _constants(profiling, "FLOPS_PROFILER_"),
            swap.AIO: _constants(swap, "AIO_")}


@functools.lru_cache(maxsize=None)
def top_level_keys() -> frozenset:
    """Every top-level key DeepSpeed 0.19.8 reads."""
    seen = set()
    _parse(_RecordingDict(seen, (), _BATCH))
    # sequence_parallel_size: read only without an mpu (runtime/config.py:468-470), which the probe passes
    return frozenset({path[0] for path in seen} | set(_model_sections()) | set(_other_sections())
                     | {"sequence_parallel_size"})


@functools.lru_cache(maxsize=None)
def section_probe(section: str) -> tuple:
    """(keys DeepSpeed reads inside `section`, or None where they are not known; DeepSpeed's own message when
    0.19 removed the section, else None). `section` is a top-level key of `top_level_keys()`."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    from deepspeed.runtime.config import DeepSpeedConfigError

    if section in _other_sections():
        keys = _other_sections()[section]
        return (frozenset(keys) if keys is not None else None), None
    seen = set()
    try:
        _parse(_RecordingDict(seen, (), {**_BATCH, section: _RecordingDict(seen, (section,))}))
    except DeepSpeedConfigError as e:  # a section 0.19 removed: DeepSpeed says what replaced it
        return None, " ".join(str(e).split())
    except Exception:  # a scalar key given an empty object: it has no sub-keys to check
        pass
    model = _model_sections().get(section)
    if model is not None and issubclass(model, DeepSpeedConfigModel):
        return frozenset(_model_keys(model)), None
    nested = {path[1] for path in seen if len(path) == 2 and path[0] == section}
    return (frozenset(nested) if nested else None), None


def nested_model_keys(section: str, key: str) -> frozenset | None:
    """Keys of a model nested in a pydantic section (`zero_optimization.offload_optimizer`), else None."""
    model = _model_sections().get(section)
    nested = _model_keys(model).get(key) if model is not None else None
    return frozenset(_model_keys(nested)) if nested is not None else None



@functools.lru_cache(maxsize=None)
def launcher_flags() -> frozenset:
    """The `deepspeed` runner's own flags (`num_gpus`, `hostfile`, `master_port`, ...): they go before the
    script; after it the runner passes them to the script as arguments."""
    from deepspeed.launcher import runner

    return frozenset(vars(runner.parse_args(["script.py"]))) - {"user_script", "user_args"}
