"""Every command in README.md, docs/*.md and the example plugin's README works as written.

- every ```toml block is a valid servelab config (or pyproject.toml excerpt);
- every ```python block compiles;
- every `servelab ...` command (in ```bash blocks, `$ ` lines of other blocks, and inline
  code) parses with the CLI's own parser, and the files, built-in models, `--set`
  assignments and workload specs it names exist and are valid;
- every `python ...` and `pip install ...` command names a script, module, folder or
  extra that exists;
- the cheap commands (`servelab plugins`, `servelab generate`) in ```bash blocks run and
  exit 0.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from servelab import cli
from servelab.config import EngineConfig
from servelab.model.named_models import NAMED_MODELS
from servelab.workload import build_workload

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples/servelab-sjf/README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`]+)`")
PROGRAMS = ("servelab", "python", "python3", "pip")
BUILTIN_MODELS = {"builtin:tiny", "builtin:tiny-draft", "builtin:tiny-random", *NAMED_MODELS}


def _blocks(language: str) -> list[tuple[str, str]]:
    return [(f"{page.name}:{page.read_text()[:m.start()].count(chr(10)) + 1}", m.group(2))
            for page in PAGES for m in FENCE.finditer(page.read_text()) if m.group(1) == language]


def _command_lines(page: Path) -> list[tuple[str, str]]:
    """(where, command) for every shell command on `page`, continuation lines joined."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        language, body = match.groups()
        line_number = text[:match.start()].count("\n") + 2
        joined = body.replace("\\\n", " ")
        for line in joined.splitlines():
            where = f"{page.name}:{line_number}"
            if language not in ("bash", "sh"):
                if not line.startswith("$ "):
                    continue
                line, where = line[2:], f"{where} (shown with its output)"
            if line.strip() and not line.lstrip().startswith("#"):
                found.append((where, line))
    prose = FENCE.sub("", text)
    for match in INLINE.finditer(prose):
        command = " ".join(match.group(1).split())
        if _program(command) in PROGRAMS and " " in command:
            found.append((f"{page.name} (inline)", command))
    return found


def _program(command: str) -> str:
    words = [w for w in command.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    return words[0] if words else ""


def _expand_braces(word: str) -> list[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [expanded for choice in match.group(1).split(",")
            for expanded in _expand_braces(word[:match.start()] + choice + word[match.end():])]


def _commands() -> list[tuple[str, list[str]]]:
    """(where, argv) for every command, split at && and ;, environment assignments dropped."""
    result = []
    for page in PAGES:
        for where, line in _command_lines(page):
            words = [expanded for word in shlex.split(line, comments=True) for expanded in _expand_braces(word)]
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", ";"):
                    if command:
                        result.append((where, command))
                    command = []
                elif command or not re.fullmatch(r"[A-Z_]+=\S*", word):
                    command.append(word)
    return result


COMMANDS = _commands()
SERVELAB = [(where, argv) for where, argv in COMMANDS if argv[0] == "servelab"]
OTHERS = [(where, argv) for where, argv in COMMANDS if argv[0] in PROGRAMS[1:]]


def _ids(cases):
    return [f"{where}: {' '.join(argv)[:60]}" for where, argv in cases]


def test_the_pages_hold_commands_to_check():
    assert len(SERVELAB) >= 20 and len(OTHERS) >= 5  # the extraction itself still finds them
    assert len(_blocks("toml")) >= 5 and len(_blocks("python")) >= 5


@pytest.mark.parametrize("where, body", _blocks("toml"), ids=[w for w, _ in _blocks("toml")])
def test_toml_block_is_a_valid_config(where, body):
    data = tomllib.loads(body)
    if "project" in data:  # a pyproject.toml excerpt: its entry points name a module
        for group in data["project"].get("entry-points", {}).values():
            assert all(re.fullmatch(r"[\w.]+(:\w+)?", target) for target in group.values()), group
        return
    EngineConfig.load(data)


@pytest.mark.parametrize("where, body", _blocks("python"), ids=[w for w, _ in _blocks("python")])
def test_python_block_compiles(where, body):
    compile(body, where, "exec")


def _is_placeholder(value: str) -> bool:
    return value.isupper() or value.startswith("path/to/")


@pytest.mark.parametrize("where, argv", SERVELAB, ids=_ids(SERVELAB))
def test_servelab_command_parses_and_names_what_exists(where, argv):
    try:
        args = cli.parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse (exit {exc.code})")
    configs = args.configs if args.command == "bench" else [getattr(args, "config", None)]
    models = set()
    for path in filter(None, configs):
        assert (ROOT / path).is_file(), f"{where}: no config file {path}"
        models.add(EngineConfig.load(ROOT / path).with_set_options(getattr(args, "assignments", [])).engine.model)
    if args.command == "bench" and not args.model:
        assert len(models) <= 1, f"{where}: the bench refuses configs naming different models: {models}"
    model = getattr(args, "model", None)
    if model and not _is_placeholder(model):
        assert model in BUILTIN_MODELS, f"{where}: unknown model {model}"
    EngineConfig().with_set_options(getattr(args, "assignments", []))
    if args.command in ("bench", "size") and args.workload:
        build_workload(args.workload, vocab_size=4096)


@pytest.mark.parametrize("where, argv", OTHERS, ids=_ids(OTHERS))
def test_python_and_pip_commands_name_what_exists(where, argv):
    program, rest = argv[0], argv[1:]
    if program == "pip":
        assert rest[0] == "install", f"{where}: {argv}"
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in rest[1:]:
            local = re.fullmatch(r"([.\w/-]+?)(?:\[([\w,]+)\])?", word)
            if word.startswith("-") or not local or not local.group(1).startswith((".", "examples")):
                continue  # an option or a package from the index
            assert (ROOT / local.group(1)).is_dir(), f"{where}: no folder {local.group(1)}"
            for extra in filter(None, (local.group(2) or "").split(",")):
                assert local.group(1) != "." or extra in extras, f"{where}: no extra [{extra}]"
    elif rest[0] == "-c":
        compile(rest[1], where, "exec")
    elif rest[0] == "-m":
        assert importlib.util.find_spec(rest[1]) is not None, f"{where}: no module {rest[1]}"
    else:
        assert (ROOT / rest[0]).is_file(), f"{where}: no script {rest[0]}"


# Each distinct command once (the same quickstart line is on several pages).
RUNNABLE = list({tuple(argv): (where, argv) for where, argv in reversed(SERVELAB)
                 if "(" not in where and argv[1] in ("plugins", "generate")}.values())[::-1]


@pytest.fixture
def unconfigured_logging_afterwards():
    import structlog

    yield
    structlog.reset_defaults()


@pytest.mark.parametrize("where, argv", RUNNABLE, ids=_ids(RUNNABLE))
def test_cheap_commands_run(where, argv, monkeypatch, capsys, unconfigured_logging_afterwards):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cli.main(argv[1:]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()


def test_plugins_page_lists_every_built_in_policy():
    """docs/plugins.md's table names every policy this distribution registers."""
    from servelab.registry import PluginRegistry

    table = (ROOT / "docs/plugins.md").read_text()
    listed = set(re.findall(r"^\| [a-z_]+ \| `([a-z0-9_-]+)` \|", table, re.MULTILINE))
    described = PluginRegistry.from_entry_points().describe()
    built_in = {p["name"] for policies in described.values() for p in policies if p["distribution"] == "servelab"}
    assert built_in - listed == set(), f"docs/plugins.md lacks {sorted(built_in - listed)}"
