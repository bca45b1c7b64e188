"""Architecture rules, checked on the source: core never imports the built-in plugins,
plugins reach core only through its public contract, discovery stays torch-free, and
every module imports cleanly with warnings as errors."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"servelab": ROOT / "core", "servelab.plugins": ROOT / "plugins"}
PLUGIN_MAY_IMPORT = {"servelab", "servelab.interfaces", "servelab.errors", "servelab.options", "servelab.plugin_types"}


def module_name(path: Path) -> str:
    for package, folder in PACKAGES.items():
        if folder in path.parents:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise ValueError(path)


def modules(package: str) -> list[Path]:
    return sorted(PACKAGES[package].rglob("*.py"))


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


def imports_of(path: Path) -> list[str]:
    return imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")


def test_import_scanner_sees_every_form():
    source = ("import servelab.plugins.allocators\nfrom servelab import config, hookimpl\n"
              "from . import paged\ndef f():\n    from servelab.engine import LLMEngine\n")
    found = imported_modules(source, "servelab.plugins.allocators", is_package=True)
    assert found == ["servelab.plugins.allocators", "servelab", "servelab.config",
                     "servelab.plugins.allocators", "servelab.plugins.allocators.paged", "servelab.engine"]


def test_core_never_imports_the_plugins_package():
    violations = [f"{module_name(p)} imports {m}" for p in modules("servelab") for m in imports_of(p)
                  if is_in_plugins(m)]
    assert modules("servelab")
    assert violations == []


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
    names = sorted(module_name(p) for package in PACKAGES for p in modules(package))
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
    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, prefix in (("core", "servelab"), ("plugins", "servelab.plugins")):
        for init in (root / top).rglob("__init__.py"):
            relative = init.parent.relative_to(root / top).parts
            found.add(".".join((prefix, *relative)))
    assert found - listed == set(), "packages missing from pyproject.toml"


# getattr(obj, "name", ...) with a literal name is a probe for a member some contract may
# or may not declare. Every optional member the code relies on is declared as a
# capability Protocol in servelab.interfaces and found with isinstance instead; the
# probes left read things that are not servelab contracts.
PROBES_ALLOWED = {
    ("servelab.model.memory", "madvise"): "a libc symbol, absent on some platforms",
    ("servelab.model.memory", "malloc_trim"): "a libc symbol, absent outside glibc",
    ("servelab.server.replicas", "cause"): "Ray's exception wrapper carries the actor's error",
    ("servelab.bench.vllm_baseline", "name"): "the peer's log is a file or a stream",
}


def literal_probes(source: str) -> list[str]:
    return [node.args[1].value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)]


def test_no_undeclared_member_probes():
    found = {(module_name(p), name) for package in PACKAGES for p in modules(package)
             for name in literal_probes(p.read_text())}
    assert found - set(PROBES_ALLOWED) == set()
