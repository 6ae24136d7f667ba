"""The DeepSpeed JSON and its "hybrid3d" section: typed sections (sections.py), checks of the DeepSpeed
keys (ds_checks.py), the parsed whole (run_config.py) and command-line overrides (overrides.py)."""
