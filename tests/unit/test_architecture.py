"""The package's shape: each subpackage is one layer, imports point down the layers only, no import
cycle between modules, no module over 400 lines, every user-facing error derives from UserError."""

import ast
import inspect
from pathlib import Path

import hybrid3d
import hybrid3d.errors

PACKAGE = Path(hybrid3d.__file__).parent
# Lowest first: a module may import from its own layer and the layers before it.
LAYERS = ["errors", "ds_internals", "parallel", "model", "config", "data", "checkpoint", "planning", "training",
          "convert", "plan", "verify", "pretrained"]
MAX_LINES = 400


def modules() -> dict:
    """{'hybrid3d.x.y': path} for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path) -> set:
    """hybrid3d modules imported by the file, at any depth (lazy imports inside functions count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybrid3d"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hybrid3d"))
    return found


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def graph() -> dict:
    mods = modules()
    return {name: {m for m in imports(path) if m in mods and m != name} for name, path in mods.items()}


def test_imports_point_down_the_layers():
    upward = [(m, i) for m, deps in graph().items() if m != "hybrid3d" for i in deps if layer(i) > layer(m)]
    assert not upward, upward


def test_no_import_cycles():
    edges = graph()
    for pkg in list(edges):  # importing a package's submodule does not import its siblings
        edges[pkg] = {d for d in edges[pkg] if not (d.startswith(pkg + ".") and pkg.count(".") < d.count("."))}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in edges[node]:
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in edges:
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_modules_are_small():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_error_class_lives_in_errors_module():
    """User-facing errors are defined once, in hybrid3d/errors.py (UnknownPresetError, a UserError
    that is also a KeyError for dict-style lookups, is the one subclass kept next to its table)."""
    defined = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith("Error") or b.id == "Exception") for b in node.bases):
                defined[node.name] = name
    assert {n: m for n, m in defined.items() if m != "hybrid3d.errors"} == {"UnknownPresetError": "hybrid3d.model.presets"}
    user_errors = [c for _, c in inspect.getmembers(hybrid3d.errors, inspect.isclass) if issubclass(c, Exception)]
    # the two that are not the user's input: a numerical blow-up, and a rank or node that went away
    assert all(issubclass(c, hybrid3d.errors.UserError) or c.__name__ in ("NonFiniteError", "PeerLostError")
               for c in user_errors)


def test_one_place_starts_the_world():
    """Only parallel/world.py calls `init_distributed`, after selecting the rank's device: a launched job or
    `hybrid3d.verify` that started the world itself would leave every rank's device at cuda:0."""
    callers = sorted(name for name, path in modules().items() if "init_distributed(" in path.read_text()
                     and name != "hybrid3d.parallel.world")
    assert callers == [], callers
    source = (PACKAGE / "parallel" / "world.py").read_text()
    assert source.index("set_device(") < source.index("init_distributed(")


REPO = PACKAGE.parent
# Files outside hybrid3d/ds_internals/ that name a DeepSpeed private, and why (nothing in the package itself)
DEEPSPEED_PRIVATES_ALLOWED = {
    ("tests/launcher/test_reliability.py", "_exit"): "os._exit, the standard library's (DeepSpeed has one too)",
    ("hybrid3d/training/watchdog.py", "_exit"): "os._exit, the standard library's (DeepSpeed has one too)",
    ("benchmarks/report.py", "_bytes"): "a column-name suffix of the results, not DeepSpeed's attribute",
    ("tests/distributed/engine_worker.py", "_compiled_call_impl"): "torch.nn.Module.compile's compiled forward, "
                                                                   "torch's attribute (DeepSpeed's engine names it too)",
}


def _privates_defined(paths) -> set:
    """Single-underscore names a set of files defines: functions, classes, assigned attributes and names."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_deepspeed_privates_are_named_inside_ds_internals_only():
    """Outside the version-checked boundary (hybrid3d/ds_internals/), no module, benchmark or test names a private
    of DeepSpeed's (an `x._name` attribute, an imported `_name`, or `"_name"` as a key, e.g. of the comms logger's
    callers) unless DEEPSPEED_PRIVATES_ALLOWED says why. Names our own code outside the boundary defines are ours."""
    import deepspeed

    ours = [p for base in ("hybrid3d", "benchmarks", "tests", "launch") for p in (REPO / base).rglob("*.py")
            if "ds_internals" not in p.parts and p != Path(__file__)]  # this file names them in its allowlist
    deepspeed_privates = _privates_defined(Path(deepspeed.__file__).parent.rglob("*.py")) - _privates_defined(ours)
    found = set()
    for path in ours:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names = [node.value]
            found.update((str(path.relative_to(REPO)), n) for n in names if n in deepspeed_privates)
    assert found <= set(DEEPSPEED_PRIVATES_ALLOWED), sorted(found - set(DEEPSPEED_PRIVATES_ALLOWED))


def test_each_shared_constant_is_defined_once():
    """A rule written twice drifts: each of these names is assigned at module level in exactly one module."""
    shared = {"IGNORE_INDEX", "SCHEDULES", "SECTION", "CLIENT_SECTION", "MANIFEST_KEY", "META_FILE",
              "STRUCTURAL_FIELDS", "TESTED_MOE_LAYOUTS", "TESTED_DEEPSPEED", "CALLER_CLASSES", "TRAFFIC_CLASSES"}
    owners = {}
    for name, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name) and target.id in shared:
                    owners.setdefault(target.id, []).append(name)
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    assert set(owners) == shared, shared - set(owners)


# Where a DeepSpeed or hybrid3d config key is read outside config/ by a name that is not the run's config, and why
CONFIG_KEYS_ALLOWED = {
    ("hybrid3d/training/job.py", "checkpoint"): "an asynchronous save's report (`CheckpointSaver.poll`), not a config",
}


def _keys_indexed(path: Path, keys: set) -> set:
    """(file, key) for each `x[key]`, `x.get(key, ...)`, `x.setdefault(key, ...)` or `x.pop(key, ...)` in the file
    whose key is a string constant in `keys` or the name SECTION (config.sections': "hybrid3d")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        index = None
        if isinstance(node, ast.Subscript):
            index = node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
              and node.func.attr in ("get", "setdefault", "pop")):
            index = node.args[0]
        key = (index.value if isinstance(index, ast.Constant) else
               "hybrid3d" if isinstance(index, ast.Name) and index.id == "SECTION" else None)
        if isinstance(key, str) and key in keys:
            found.add((str(path.relative_to(REPO)), key))
    return found


def test_config_sections_are_read_in_config_only():
    """Start-up's one direction of travel (training/entry.py): the JSON is read, resolved, validated and written in
    config/ only, so a new key is a field of the schema plus its consumer. Outside config/ (and the DeepSpeed
    boundary, ds_internals/, which hands DeepSpeed its dict) no module indexes the hybrid3d section or a top-level
    DeepSpeed key; and config/ imports nothing from planning/ or training/."""
    from hybrid3d.config.sections import SECTION
    from hybrid3d.ds_internals.config_keys import top_level_keys

    keys = set(top_level_keys()) | {SECTION}
    outside = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in ("config", "ds_internals")]
    found = set().union(*(_keys_indexed(p, keys) for p in outside))
    assert found <= set(CONFIG_KEYS_ALLOWED), sorted(found - set(CONFIG_KEYS_ALLOWED))
    upward = sorted((m, i) for m, deps in graph().items() if m.startswith("hybrid3d.config")
                    for i in deps if i.split(".")[1] in ("planning", "training"))
    assert upward == [], upward


def test_config_key_scan_finds_an_index():
    """The scan above sees each way a key is read (so its empty result means something)."""
    import tempfile

    source = ('raw[SECTION]\nraw.get("zero_optimization", {})\nds.setdefault("bf16", {})\nds.pop("fp16")\n'
              'x["other"]\ny[OTHER]\n')
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=REPO, delete=True) as f:
        f.write(source)
        f.flush()
        found = {key for _, key in _keys_indexed(Path(f.name), {"hybrid3d", "zero_optimization", "bf16", "fp16"})}
    assert found == {"hybrid3d", "zero_optimization", "bf16", "fp16"}
