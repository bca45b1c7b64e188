"""Architecture rules, checked on the source: the engine core never imports its wings
nor the built-in plugins, plugins reach the core only through its public contract,
discovery stays torch-free, and every module imports cleanly with warnings as errors."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import package -> folder, as pyproject.toml maps them (setuptools package-dir).
PACKAGES = {name: ROOT / folder for name, folder in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}
WINGS = ("servelab.cli", "servelab.server", "servelab.bench", "servelab.testing", "servelab.distributed")
PLUGIN_MAY_IMPORT = {"servelab", "servelab.interfaces", "servelab.errors", "servelab.options", "servelab.plugin_types",
                     "servelab.kit", "servelab.contracts"}
# The engine core in layers, lowest first: a module imports its own layer and the ones
# below, never one above (the wings sit above them all, the plugins beside the wings).
# Records: the plain data every layer passes around; contracts: one module per policy
# kind (servelab.contracts) and their re-export; model and kit: the parts the engine is
# built of; engine: the rest of the core, the `servelab` package itself among it.
RECORD_MODULES = {"servelab.errors", "servelab.logging_setup", "servelab.sampling_params", "servelab.sequence",
                  "servelab.token_tree", "servelab.kv_sizing", "servelab.options", "servelab.structured",
                  "servelab.defaults"}


def module_name(path: Path) -> str:
    for package, folder in sorted(PACKAGES.items(), key=lambda item: -len(str(item[1]))):  # the deepest folder
        if folder in path.parents:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise ValueError(path)


def modules(package: str) -> list[Path]:
    """The files of `package` and of every package under it, wherever they are mapped."""
    files = {p for folder in PACKAGES.values() for p in folder.rglob("*.py")}
    return sorted(p for p in files if module_name(p) == package or module_name(p).startswith(package + "."))


def imported_modules(source: str, name: str, is_package: bool) -> list[str]:
    """Every servelab module `source` (the module `name`) imports, as absolute names.

    `from servelab import x` counts as importing `servelab.x` when x is a submodule.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append(target)
            found.extend(f"{target}.{alias.name}" for alias in node.names
                         if is_submodule(f"{target}.{alias.name}"))
    return [m for m in found if m == "servelab" or m.startswith("servelab.")]


def is_submodule(dotted: str) -> bool:
    for package, folder in sorted(PACKAGES.items(), key=lambda item: -len(item[0])):
        if dotted == package or dotted.startswith(package + "."):
            rest = dotted[len(package):].lstrip(".").split(".") if dotted != package else []
            target = folder.joinpath(*rest)
            return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()
    return False


def is_in_plugins(module: str) -> bool:
    return module == "servelab.plugins" or module.startswith("servelab.plugins.")


def wing_of(module: str) -> str | None:
    return next((w for w in WINGS if module == w or module.startswith(w + ".")), None)


def core_modules() -> list[Path]:
    """The engine core: the `servelab` package without its wings and the plugins."""
    return [p for p in modules("servelab") if wing_of(module_name(p)) is None and not is_in_plugins(module_name(p))]


def imports_of(path: Path) -> list[str]:
    return imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")


def dependencies(path: Path) -> set[str]:
    """The servelab modules `path` needs, for the layering and cycle rules: as
    `imports_of`, except that `from package import submodule` needs the submodule alone
    (Python imports every parent package first whatever the form, so that edge says nothing)."""
    tree = ast.parse(path.read_text())
    names = imports_of(path)
    bare = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if all(is_submodule(f"{node.module}.{alias.name}") for alias in node.names):
                bare.add(node.module)
    own = module_name(path)
    return {m for m in names if m not in bare and m != own}


def layer_of(module: str) -> int:
    """0 records, 1 contracts, 2 model, 3 kit, 4 the rest of the engine core, 5 wings and plugins."""
    if wing_of(module) or is_in_plugins(module):
        return 5
    if module in RECORD_MODULES:
        return 0
    if module in ("servelab.interfaces", "servelab.contracts") or module.startswith("servelab.contracts."):
        return 1
    if module == "servelab.model" or module.startswith("servelab.model."):
        return 2
    if module == "servelab.kit" or module.startswith("servelab.kit."):
        return 3
    return 4


def test_import_scanner_sees_every_form():
    source = ("import servelab.plugins.allocators\nfrom servelab import config, hookimpl\n"
              "from . import radix\ndef f():\n    from servelab.engine import LLMEngine\n")
    found = imported_modules(source, "servelab.plugins.allocators", is_package=True)
    assert found == ["servelab.plugins.allocators", "servelab", "servelab.config",
                     "servelab.plugins.allocators", "servelab.plugins.allocators.radix", "servelab.engine"]


def test_core_never_imports_the_plugins_package():
    violations = [f"{module_name(p)} imports {m}" for p in modules("servelab") for m in imports_of(p)
                  if is_in_plugins(m) and not is_in_plugins(module_name(p))]
    assert modules("servelab")
    assert violations == []


def test_the_engine_core_never_imports_its_wings():
    core = core_modules()
    assert {"servelab.engine", "servelab.interfaces", "servelab.model.llama"} <= {module_name(p) for p in core}
    assert all(p.is_relative_to(ROOT / "core" / "engine") for p in core)  # one folder holds the core
    violations = [f"{module_name(p)} imports {m}" for p in core for m in imports_of(p) if wing_of(m)]
    assert violations == []


def test_wings_are_folders_beside_the_core():
    for wing in WINGS:
        assert PACKAGES[wing].parent == ROOT / "core" and PACKAGES[wing] != PACKAGES["servelab"], wing


def test_plugins_import_only_the_public_contract():
    violations = [f"{module_name(p)} imports {m}" for p in modules("servelab.plugins") for m in imports_of(p)
                  if m not in PLUGIN_MAY_IMPORT and not is_in_plugins(m)]
    assert modules("servelab.plugins")
    assert violations == []


def run_python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120)


def test_plugin_discovery_does_not_import_torch():
    result = run_python(
        "import sys, servelab\n"
        "listing = servelab.PluginRegistry.from_entry_points().describe()\n"
        "assert listing['allocators'], listing\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules)\n"
        "print(heavy)\n")
    assert result.returncode == 0, result.stderr
    assert "torch" not in result.stdout, result.stdout
    assert result.stdout.strip() == "[]"


def test_every_module_imports_with_warnings_as_errors():
    names = sorted({module_name(p) for p in modules("servelab")})
    assert "servelab.plugins.kernels.torch_paged" in names and "servelab.model.llama" in names
    code = (
        "import importlib, traceback\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except BaseException as exc:\n"
        "        print(f'{name}: {type(exc).__name__}: {exc}')\n"
    )
    result = run_python(code, "-W", "error")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "", result.stdout


def test_every_package_directory_is_listed_in_pyproject():
    """A wheel ships only the packages pyproject lists; editable installs would hide a gap."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(init) for package in PACKAGES for init in PACKAGES[package].rglob("__init__.py")}
    assert "servelab.testing" in found and "servelab.plugins.kernels" in found
    assert found - listed == set(), "packages missing from pyproject.toml"


# getattr(obj, "name", ...) with a literal name (or any other spelling of reading an
# attribute by a string: literal_probes) is a probe for a member some contract may or may not declare. Every optional member the code relies on is declared as a
# capability Protocol in servelab.interfaces and found with isinstance instead; the
# probes left read things that are not servelab contracts.
PROBES_ALLOWED = {
    ("servelab.model.memory", "madvise"): "a libc symbol, absent on some platforms",
    ("servelab.server.serve", "sched_getaffinity"): "an os function, absent outside Linux",
    ("servelab.model.packed_linear", "_reorder_linear_weight"): "a torch op, absent from some builds",
    ("servelab.model.packed_linear", "weight"): "a torch module's parameter, deleted once packed",
    ("servelab.distributed.sharded_model", "packed_weight"): "torch modules of the model, packed or not",
    ("servelab.plugins.kernels.cpu_decoder", "panels"): "torch modules of the model, packed or not",
    ("servelab.arrivals", "advance_to"): "the engine's clock is any callable; a virtual one can be advanced",
    ("servelab.testing.allocator_machine", "alloc"): "a hypothesis state machine's attribute before its first rule",
    ("servelab.model.memory", "malloc_trim"): "a libc symbol, absent outside glibc",
    ("servelab.server.replicas", "cause"): "Ray's exception wrapper carries the actor's error",
    ("servelab.bench.vllm_baseline", "name"): "the peer's log is a file or a stream",
}


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_attribute_map(node: ast.AST) -> bool:
    """`vars(x)` or `x.__dict__`: an object's attributes as a mapping."""
    return ((isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars")
            or (isinstance(node, ast.Attribute) and node.attr == "__dict__"))


def literal_probes(source: str) -> list[str]:
    """Attribute reads by a literal name, in every spelling: getattr / hasattr(obj, "name"),
    obj.__getattribute__("name"), object.__getattribute__(obj, "name"),
    operator.attrgetter("name"), vars(obj)["name"], obj.__dict__["name"] and their `.get`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_attribute_map(node.value) and _literal(node.slice):
            found.append(_literal(node.slice))
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, node.args
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in ("getattr", "hasattr") and isinstance(func, ast.Name) and len(args) >= 2 and _literal(args[1]):
            found.append(_literal(args[1]))
        elif name == "__getattribute__" and args:  # never needed: a computed name is a probe too
            found.append(_literal(args[-1]) or "<computed>")
        elif name == "attrgetter":
            found.extend(_literal(arg) or "<computed>" for arg in args)
        elif (name == "get" and isinstance(func, ast.Attribute) and _is_attribute_map(func.value) and args
              and _literal(args[0])):
            found.append(_literal(args[0]))
    return found


def test_the_probe_finder_sees_every_spelling():
    source = ("getattr(a, 'one')\nhasattr(a, 'two')\na.__getattribute__('three')\n"
              "object.__getattribute__(a, 'four')\noperator.attrgetter('five')\nattrgetter('six', 'seven')\n"
              "vars(a)['eight']\na.__dict__['nine']\nvars(a).get('ten')\na.__dict__.get('eleven', 0)\n"
              "getattr(a, name)\nd['twelve']\nd.get('thirteen')\noptions.__getattribute__(name)\n")
    assert sorted(literal_probes(source)) == sorted(["one", "two", "three", "four", "five", "six", "seven", "eight",
                                                     "nine", "ten", "eleven", "<computed>"])


def test_no_undeclared_member_probes():
    found = {(module_name(p), name) for p in modules("servelab")
             for name in literal_probes(p.read_text())}
    assert found - set(PROBES_ALLOWED) == set()


def import_graph() -> dict[str, set[str]]:
    graph = {module_name(p): dependencies(p) for p in modules("servelab")}
    return {m: {t for t in targets if t in graph} for m, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """Imports inside functions count: hiding a cycle there is still a cycle."""
    graph = import_graph()
    assert "servelab.server.intake" in graph["servelab.server.engine_core"]
    assert cycles(graph) == []


def test_no_imports_running_back_up():
    assert layer_of("servelab.model.llama") < layer_of("servelab.runner")
    assert layer_of("servelab.contracts.scheduler") < layer_of("servelab.model.llama")
    upward = sorted(f"{module} imports {target}" for module, targets in import_graph().items()
                    for target in targets if layer_of(target) > layer_of(module))
    assert upward == []


def test_record_modules_exist():
    names = {module_name(p) for p in modules("servelab")}
    assert RECORD_MODULES <= names
