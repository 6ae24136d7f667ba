"""The package's shape: each subpackage is one layer, imports point down the layers only, no import
cycle between modules, no module over 400 lines, every user-facing error derives from UserError."""

import ast
import inspect
from pathlib import Path

import hybrid3d
import hybrid3d.errors

PACKAGE = Path(hybrid3d.__file__).parent
# Lowest first: a module may import from its own layer and the layers before it.
LAYERS = ["errors", "ds_internals", "parallel", "config", "model", "data", "checkpoint", "planning", "training",
          "convert", "plan", "verify"]
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
