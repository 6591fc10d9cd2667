"""Layering rules of the code base (docs/architecture.md), checked so they stay true.

The import rules are read from the "Layering rules" section of docs/architecture.md itself, so the doc
and this test cannot drift apart: a rule added there is checked here, a line this parser cannot read fails.
"""

from __future__ import annotations

import ast
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import networkx
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "forwardpass"
ENGINE = PACKAGE / "engine"
ARCHITECTURE = REPO / "docs" / "architecture.md"
SECTION = "## Layering rules"

# ----- the rules, from the doc ------------------------------------------------------------------------------
_NAME = r"\w+(?:\.\w+)*"  # a package, or a sub-package spelled with dots: engine.scheduling
_NOT = re.compile(rf"({_NAME}) → not ({_NAME}(?:, {_NAME})*)")  # layers → not models, engine
_ONLY = re.compile(r"only (\w+) → (\w+(?:, \w+)*)")  # only server → fastapi, uvicorn


@dataclass(frozen=True)
class Rule:
    text: str  # the line as the doc writes it
    kind: str  # "not": `source` imports none of `targets` (forwardpass packages); "only": nothing outside
    source: str  # `source` imports any of `targets` (third-party packages)
    targets: frozenset[str]


def parse_rule(line: str) -> Rule:
    """One rule line of the section (``- ...``, backticks allowed); ``ValueError`` if it is neither form."""
    text = line.strip().removeprefix("- ").replace("`", "").strip()
    for kind, pattern in (("not", _NOT), ("only", _ONLY)):
        if m := pattern.fullmatch(text):
            return Rule(text, kind, m.group(1), frozenset(m.group(2).split(", ")))
    raise ValueError(f"not a layering rule ('A → not B, C' or 'only A → X, Y'): {line!r}")


def section_lines(doc: str) -> list[str]:
    """The list items of the doc's "Layering rules" section (up to the next ``## `` heading)."""
    lines = doc.splitlines()
    try:
        start = lines.index(SECTION) + 1
    except ValueError:
        return []
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [line for line in lines[start:end] if line.startswith("- ")]


def doc_rules() -> list[Rule]:
    return [parse_rule(line) for line in section_lines(ARCHITECTURE.read_text())]


# ----- the imports, from the code ---------------------------------------------------------------------------
def top_level(module: str) -> str:
    """The first name under ``forwardpass`` of a dotted module (``forwardpass.models.loading`` → ``models``),
    ``forwardpass`` for the root package's own names, the distribution for anything else (``fastapi``)."""
    parts = module.split(".")
    if parts[0] != "forwardpass":
        return parts[0]
    if len(parts) == 1 or not ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
        return "forwardpass"  # `from forwardpass import LLM`: the root package's (lazy) re-export
    return parts[1]


def within(module: str, name: str) -> bool:
    """Whether the dotted ``module`` is ``forwardpass/<name>`` or inside it (``name`` may have dots:
    ``engine.scheduling``)."""
    return module == f"forwardpass.{name}" or module.startswith(f"forwardpass.{name}.")


def module_name(rel: str) -> tuple[str, bool]:
    """``("forwardpass.layers.moe", False)`` for ``layers/moe.py``; ``(package, True)``
    for an ``__init__.py``."""
    parts = ("forwardpass", *Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imports(source: str, rel: str, *, type_only: bool = True) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import statement anywhere in the module at ``forwardpass/<rel>``:
    top level, functions, ``if TYPE_CHECKING:`` blocks (``type_only=False``: those left out, as the
    interpreter never runs them). ``from X import y`` gives ``X.y`` (``y`` may be a
    submodule: ``from forwardpass import envs``); relative imports are resolved against
    the module's package."""
    name, is_package = module_name(rel)
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    tree = ast.parse(source, rel)
    skipped = set() if type_only else {id(n) for block in ast.walk(tree) if _type_checking(block)
                                       for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1
                if up >= len(package):
                    raise ValueError(f"forwardpass/{rel}:{node.lineno}: relative import beyond the top-level "
                                     "package")
                base = package[: len(package) - up]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found += [(node.lineno, module if a.name == "*" else f"{module}.{a.name}") for a in node.names]
    return sorted(found)


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def import_graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    """Each module's run-time imports of other ``forwardpass`` modules (type-only ones left out), and each
    module's folder (``engine/scheduling``; an ``__init__.py`` belongs to its own folder)."""
    sources = {module_name(rel)[0]: (rel, source) for rel, source in _modules()}
    folders = {name: Path(rel).parent.as_posix() for name, (rel, _) in sources.items()}

    def resolve(module: str) -> str:  # `from a.b import c`: the module a.b.c where it is one, else a.b
        while module not in sources:
            module = module.rpartition(".")[0]
        return module

    graph = {name: {resolve(m) for _, m in imports(source, rel, type_only=False)
                    if m.split(".")[0] == "forwardpass"} - {name}
             for name, (rel, source) in sources.items()}
    return graph, folders


def forbidden_cycles(graph: dict[str, set[str]], folders: dict[str, str]) -> list[list[str]]:
    """The import cycles (strongly connected modules) that join modules of different folders, or any two
    modules under engine/."""
    g = networkx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    found = []
    for cycle in networkx.strongly_connected_components(g):
        places = {folders[m] for m in cycle}
        if len(cycle) > 1 and (len(places) > 1 or any(p.split("/")[0] == "engine" for p in places)):
            found.append(sorted(cycle))
    return sorted(found)


def violations(rule: Rule, source: str, rel: str) -> list[str]:
    """``forwardpass/<rel>:<line>: imports <module> (<package>)`` for each import of the module
    that breaks ``rule``."""
    name, _ = module_name(rel)
    out = []
    for line, module in imports(source, rel):
        hit = None
        if rule.kind == "not" and within(name, rule.source):
            hit = next((t for t in sorted(rule.targets) if within(module, t)), None)
        elif rule.kind == "only" and module.split(".")[0] != "forwardpass" and not within(name, rule.source):
            hit = top_level(module) if top_level(module) in rule.targets else None
        if hit is not None:
            out.append(f"forwardpass/{rel}:{line}: imports {module} ({hit})")
    return out


def _modules() -> list[tuple[str, str]]:
    return [(p.relative_to(PACKAGE).as_posix(), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


# ----- the tests --------------------------------------------------------------------------------------------
def test_the_doc_states_the_rules_and_each_line_is_read():
    """An emptied or missing section, or a rule line in another shape, fails here rather
    than checking nothing."""
    lines = section_lines(ARCHITECTURE.read_text())
    assert lines, f"no rules found under {SECTION!r} in {ARCHITECTURE.relative_to(REPO)}"
    rules = [parse_rule(line) for line in lines]  # raises on a line it cannot read
    assert len(rules) == len(lines) == len({r.text for r in rules})
    by_source = {(r.kind, r.source): r.targets for r in rules}
    # issue #38's rules must stay in the list
    assert {"models", "engine"} <= by_source.get(("not", "layers"), frozenset())
    assert "engine" in by_source.get(("not", "lora"), frozenset())
    assert "fastapi" in by_source.get(("only", "server"), frozenset())
    assert "analysis" in by_source.get(("not", "engine"), frozenset())


def test_every_forwardpass_name_in_a_rule_exists():
    """A package renamed or removed makes its rules stale; say so instead of checking nothing."""
    for rule in doc_rules():
        names = {rule.source} | (rule.targets if rule.kind == "not" else set())
        for n in names:
            path = PACKAGE / n.replace(".", "/")
            assert path.is_dir() or path.with_suffix(".py").is_file(), f"{rule.text!r}: no {path}"


@pytest.mark.parametrize("rule", doc_rules(), ids=lambda r: r.text.replace("→", "->"))
def test_every_module_obeys_the_rule(rule: Rule):
    found = [v for rel, source in _modules() for v in violations(rule, source, rel)]
    assert found == [], (f"{rule.text!r} (docs/architecture.md, Layering rules) is broken:\n"
                         + "\n".join(found))


FAKE = """\
from __future__ import annotations
from typing import TYPE_CHECKING
import torch
from forwardpass.layers.linear import Linear
from forwardpass import envs
from ..models import llama
from . import norm
if TYPE_CHECKING:
    from forwardpass.engine.scheduling.sequence import Sequence
def load():
    import forwardpass.engine.worker.model_runner as runner
    from forwardpass.models.loading import _checkpoint_names
    import fastapi.responses
"""


def test_an_injected_violation_is_found():
    rule = parse_rule("- layers → not `models`, engine")
    assert (rule.kind, rule.source, rule.targets) == ("not", "layers", {"models", "engine"})
    assert violations(rule, FAKE, "layers/fake.py") == [
        "forwardpass/layers/fake.py:6: imports forwardpass.models.llama (models)",  # relative, two levels up
        # type-only
        "forwardpass/layers/fake.py:9: imports forwardpass.engine.scheduling.sequence.Sequence (engine)",
        # inside a function
        "forwardpass/layers/fake.py:11: imports forwardpass.engine.worker.model_runner (engine)",
        "forwardpass/layers/fake.py:12: imports forwardpass.models.loading._checkpoint_names (models)",
    ]
    assert violations(rule, FAKE, "attention/fake.py") == []  # the rule is about layers/ only
    assert violations(rule, "from ... import engine\nfrom .. import engine\n", "layers/sub/__init__.py") == [
        # 2: forwardpass.layers.engine
        "forwardpass/layers/sub/__init__.py:1: imports forwardpass.engine (engine)"
    ]
    only = parse_rule("- only server → fastapi, uvicorn")
    assert violations(only, FAKE, "layers/fake.py") == ["forwardpass/layers/fake.py:13: imports "
                                                        "fastapi.responses (fastapi)"]
    assert violations(only, FAKE, "server/fake.py") == []
    # ours, not theirs
    assert violations(only, "from forwardpass.server import fastapi\n", "engine/fake.py") == []
    sub = parse_rule("- engine.scheduling → not engine.worker, engine.speculative")  # sub-packages, dotted
    two = "from forwardpass.engine.worker.isolation import Sampled\nfrom forwardpass.engine import core\n"
    assert violations(sub, two, "engine/scheduling/fake.py") == [
        "forwardpass/engine/scheduling/fake.py:1: imports forwardpass.engine.worker.isolation.Sampled "
        "(engine.worker)"]
    assert violations(sub, two, "engine/worker/fake.py") == []
    with pytest.raises(ValueError):
        parse_rule("- layers must not import models")


def test_engine_files_stay_small():
    sizes = {p.relative_to(ENGINE).as_posix(): len(p.read_text().splitlines()) for p in ENGINE.rglob("*.py")}
    assert len(sizes) > 20  # every sub-package's files, not only engine/*.py
    assert max(sizes.values()) <= 250, {k: v for k, v in sizes.items() if v > 250}


def test_no_import_cycle_across_folders_or_inside_the_engine():
    """A cycle between folders makes the folders one unit in all but name; inside engine/ the sub-packages
    stack one on another (docs/architecture.md)."""
    graph, folders = import_graph()
    assert len(graph) > 250 and sum(map(len, graph.values())) > 500  # the whole package was read
    found = forbidden_cycles(graph, folders)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_a_cycle_is_found():
    folders = {"a.x": "a", "a.y": "a", "b.z": "b", "engine.p": "engine", "engine.q": "engine/worker"}
    graph = {"a.x": {"a.y"}, "a.y": {"a.x", "b.z"}, "b.z": set(), "engine.p": {"engine.q"}, "engine.q": set()}
    assert forbidden_cycles(graph, folders) == []  # a cycle inside one folder outside the engine is allowed
    graph["b.z"] = {"a.x"}
    graph["engine.q"] = {"engine.p"}
    assert forbidden_cycles(graph, folders) == [["a.x", "a.y", "b.z"], ["engine.p", "engine.q"]]
    rel = "engine/fake.py"
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from forwardpass.models import llama\n"
    assert imports(typed, rel) == [(1, "typing.TYPE_CHECKING"), (3, "forwardpass.models.llama")]
    assert imports(typed, rel, type_only=False) == [(1, "typing.TYPE_CHECKING")]


def test_only_the_spec_reads_model_config_keys():
    """Models, engine, analyzer read ``ModelSpec``; config.json keys are resolved in the spec modules
    (``models/model_spec.py`` and each family's ``models/*_spec.py``), nowhere else."""
    for sub in ("engine", "models", "analysis", "layers", "attention"):
        for path in (PACKAGE / sub).rglob("*.py"):
            if sub == "models" and path.name.endswith("_spec.py"):  # a family's spec derivation
                continue
            text = path.read_text()
            for key in ('"num_hidden_layers"', '"num_key_value_heads"', '"sliding_window"', '"num_experts"'):
                assert key not in text or path.name == "presets.py", f"{path} reads {key}"


def test_the_repository_stands_alone():
    """No file points outside the repository (to notes that users do not have)."""
    outside = "../" + "shared"
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        path = REPO / name
        if (
            path.suffix in {".py", ".md", ".toml", ".txt", ".cfg", ".sh", ".json", ".html", ""}
            and path.is_file()
        ):
            assert outside not in path.read_text(errors="ignore"), name


def test_the_builder_and_tensor_parallelism_do_not_import_each_other():
    """``engine/builder.py`` builds around the executor it is handed (``engine/executor.py``);
    ``engine/frontend/launch.py``, above both, starts the tensor-parallel ranks (the rules
    ``engine.builder → not ..., distributed`` and the like cover the engine's side)."""
    found = [f"forwardpass/{rel}:{line}: imports {module}"
             for rel, source in _modules() if rel.startswith("distributed/")
             for line, module in imports(source, rel)
             if module.startswith("forwardpass.engine.builder")]
    assert not found, found


def test_the_spec_keeps_the_common_core_and_families_keep_their_own():
    """``ModelSpec``'s own fields are what every decoder has; a family's sizes live in its ``family``
    sub-spec, so no field is named after a family and the core stays about twenty fields."""
    import dataclasses

    from forwardpass.models.model_spec import ModelSpec
    from forwardpass.models.registry import _SPEC_MODEL_TYPES

    names = [f.name for f in dataclasses.fields(ModelSpec)]
    assert len(names) <= 21, names
    families = {"gemma", "mla", "deepseek", "whisper", "bert", "mamba", "ssm", "gdn", "qwen", "mixtral",
                *_SPEC_MODEL_TYPES}
    assert len(families) > 10  # the registry's model types were read
    assert not [n for n in names for fam in families if fam in n], names


#: top-level packages that import each other both ways, each without a module-level cycle, and why
TWO_WAY_PACKAGES = {
    ("distributed", "engine"): "engine/frontend/launch.py starts the tensor-parallel runtime, which runs "
                               "engine pieces on every rank",
    ("layers", "quant"): "a weight method holds a quantized weight; quantized weights multiply through the "
                         "leaf layers/dense_matmul.py",
}


def test_top_level_packages_import_each_other_one_way():
    """The package graph is a stack apart from the pairs named above (a new two-way pair is a new knot)."""
    graph, _ = import_graph()

    def package(module: str) -> str:  # forwardpass.engine.core -> engine; forwardpass/llm.py: one of its own
        return (module.split(".") + ["__init__"])[1]

    arrows = {(package(a), package(b)) for a, targets in graph.items() for b in targets
              if package(a) != package(b)}
    pairs = {tuple(sorted(p)) for p in arrows if p[::-1] in arrows}
    assert len(arrows) > 50  # the whole package was read
    assert pairs == set(TWO_WAY_PACKAGES), sorted(pairs)
