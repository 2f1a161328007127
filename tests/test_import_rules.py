"""The layering, enforced on the source (every import statement that runs, module level or inside
a function; ``if TYPE_CHECKING:`` imports are annotations only; a module named in a string, as the
registries name their built-ins and as entry points name plug-ins, counts as an import too, since it is
imported when that string is used): the pure core at the bottom, model families and formats above it,
planning and execution above those, storage beside them, Prefect tasks and flows on top, no cycles.

==================  ==================================================================================
package             must not import
==================  ==================================================================================
reshard.core        reshard.models/formats/execution/storage/tasks/flows, the CLI, fsspec, s3fs,
                    prefect, dask (pure primitives: tensor and partition math, writers, safe loading)
reshard.models      reshard.formats/execution/storage/tasks/flows (a model family knows no file
                    layout), the CLI, fsspec, s3fs, prefect, dask
reshard.formats     reshard.execution (a format is handed what it writes: ``Plan.target_state``),
                    reshard.tasks/flows, the CLI, prefect, dask
reshard.execution   reshard.storage/tasks/flows, the CLI, fsspec, s3fs, prefect, dask
reshard.storage     reshard.formats/models/execution (storage is fsspec alone; discovery, which asks the
                    formats what a listing holds, is ``reshard.discovery`` above both),
                    reshard.tasks/flows, the CLI, prefect, dask
reshard.discovery   reshard.tasks/flows, the CLI, prefect, dask
reshard.tasks       reshard.flows, the CLI (a task does not know its flow)
==================  ==================================================================================
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "reshard"

_LOWER = ("reshard.cli", "prefect", "dask", "distributed", "prefect_dask")
_STORAGE = ("reshard.storage", "reshard.tasks", "reshard.flows", "fsspec", "s3fs")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "reshard.core": ("reshard.models", "reshard.formats", "reshard.execution", *_STORAGE, *_LOWER),
    "reshard.models": ("reshard.formats", "reshard.execution", *_STORAGE, *_LOWER),
    "reshard.formats": ("reshard.execution", "reshard.tasks", "reshard.flows", *_LOWER),
    "reshard.execution": (*_STORAGE, *_LOWER),
    "reshard.storage": ("reshard.formats", "reshard.models", "reshard.execution", "reshard.tasks", "reshard.flows",
                        *_LOWER),
    "reshard.discovery": ("reshard.tasks", "reshard.flows", *_LOWER),
    "reshard.tasks": ("reshard.flows", "reshard.cli"),
}

#: A string that names a module of ours, alone or as ``module:attribute`` (registry built-ins, entry points).
_NAMED_MODULE = re.compile(r"(reshard(?:\.\w+)+)(:\w+)?")


def _is_package(path: Path) -> bool:
    """A bare package name in a string is a namespace (the entry-point groups ``reshard.formats``,
    ``reshard.models``), not an import; ``package:attribute`` still is one."""
    return path.name == "__init__.py"


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _runtime_nodes(node: ast.AST):
    """Every node except the bodies of ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
            for other in child.orelse:
                yield from _runtime_nodes(other)
            continue
        yield from _runtime_nodes(child)


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every absolute module name ``path`` imports at run time (``from a.b import c`` gives ``a.b``
    and, if it is a module of ours, ``a.b.c``), and every module of ours it names in a string
    (``"reshard.formats.hf:HFFormat"``: imported by the registry on first use)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = _NAMED_MODULE.fullmatch(node.value)
            if named and named.group(1) in modules and (named.group(2) or not _is_package(modules[named.group(1)])):
                found.add(named.group(1))
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for mod, path in modules.items():
        for package, banned in FORBIDDEN.items():
            if _under(mod, package):
                bad += [f"{mod} imports {imp}" for imp in sorted(imports_of(path, modules))
                        if any(_under(imp, b) for b in banned)]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {i for i in imports_of(p, modules) if i in modules and i != m}
            for m, p in modules.items()}


def test_each_layer_imports_only_what_it_may():
    assert violations(_modules()) == []


def test_no_import_cycles():
    assert cycles(import_graph(_modules())) == []


# the checks themselves catch what they are for

def test_the_rules_catch_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from reshard.storage.location import open_location\n    import prefect\n")
    assert violations({"reshard.core.bad": bad}) == ["reshard.core.bad imports prefect",
                                                     "reshard.core.bad imports reshard.storage.location"]


def test_a_module_named_in_a_string_is_an_import_edge(tmp_path):
    """The registries import their built-ins from "module:class" strings: a cycle through one (the
    format registry -> a format -> the engine -> the format registry) is a cycle all the same."""
    f = tmp_path / "registry.py"
    f.write_text('BUILTIN = ("reshard.formats.hf:HFFormat", "reshard.core.errors")\nNOTE = "reshard.complete"\n'
                 'GROUP = "reshard.formats"\n')
    modules = {"reshard.formats.hf": f, "reshard.core.errors": f, "reshard.formats": tmp_path / "__init__.py"}
    assert imports_of(f, modules) == {"reshard.formats.hf", "reshard.core.errors"}


def test_the_rules_catch_the_core_importing_a_format_and_a_format_the_engine(tmp_path):
    core, fmt = tmp_path / "plan.py", tmp_path / "hf.py"
    core.write_text("from reshard.formats.registry import get_format\n")
    fmt.write_text("def f():\n    from reshard.execution.engine import target_state\n")
    assert violations({"reshard.core.plan": core, "reshard.formats.hf": fmt}) == [
        "reshard.core.plan imports reshard.formats.registry", "reshard.formats.hf imports reshard.execution.engine"]


def test_type_checking_imports_are_not_run_time_edges(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import prefect\nelse:\n    import dask\n")
    assert imports_of(f, {}) == {"typing", "dask"}


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_check_finds_cycles(graph, expected):
    assert cycles(graph) == expected


# -- a model family's concepts and parameter names are spelled in its own module -----------------------
#: Fragments of the built-in families' parameter names (Megatron-LM legacy, megatron-core, Hugging Face).
FAMILY_NAMES = re.compile(r"local_experts|linear_(?:fc[12]|qkv|proj)|self_attention|query_key_value|dense_h_to_4h|"
                          r"dense_4h_to_h|word_embeddings|output_layer|language_model\.|decoder\.|model\.layers|"
                          r"shared_experts|q_proj|gate_proj|embed_tokens")
#: Words of the families' own concepts: multi-token prediction, multi-latent attention, attention
#: sinks, fused gate/up projections, Mamba and Gated DeltaNet layers, next-n prediction layers.
FAMILY_CONCEPTS = re.compile(r"mtp|mla|sinks|gate_up|mamba|deltanet|nextn", re.IGNORECASE)
#: The package that owns them; every other module (core, planner, formats, storage, tasks, flows,
#: the CLI, ...) asks the families and spells neither.
FAMILIES = "reshard.models"


def _words(node: ast.AST):
    """The strings and identifiers ``node`` itself spells: a string constant (docstrings, f-string
    parts), a name, an attribute, a function's, class's or argument's name, a keyword, an imported
    module or name, a ``global`` / ``nonlocal`` / ``except ... as`` name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield "string", node.value
    elif isinstance(node, ast.Name):
        yield "name", node.id
    elif isinstance(node, ast.Attribute):
        yield "attribute", node.attr
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield "definition", node.name
    elif isinstance(node, ast.arg):
        yield "argument", node.arg
    elif isinstance(node, ast.keyword) and node.arg:
        yield "keyword", node.arg
    elif isinstance(node, ast.alias):
        yield from (("import", n) for n in (node.name, node.asname) if n)
    elif isinstance(node, ast.ImportFrom) and node.module:
        yield "import", node.module
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
        yield from (("name", n) for n in node.names)
    elif isinstance(node, ast.ExceptHandler) and node.name:
        yield "name", node.name


def family_words_in(path: Path) -> list[str]:
    """Where ``path`` spells a family's concept (:data:`FAMILY_CONCEPTS`) or parameter names
    (:data:`FAMILY_NAMES`) in a string literal (docstrings included: prose that names a family's
    concept belongs with the family) or an identifier. Comments are not looked at."""
    return [f"{path.name}:{node.lineno} {kind} {word!r}" for node in ast.walk(ast.parse(path.read_text()))
            for kind, word in _words(node) if FAMILY_CONCEPTS.search(word) or FAMILY_NAMES.search(word)]


def family_words_outside_families(modules: dict[str, Path]) -> list[str]:
    """:func:`family_words_in` over every module of ``modules`` outside :data:`FAMILIES`."""
    return [hit for name, path in modules.items() if not _under(name, FAMILIES) for hit in family_words_in(path)]


def test_no_module_outside_the_families_spells_a_family_concept_or_parameter_name():
    """They ask the family (its rule flags, its ``layer_index`` and ``beside_stack``, its stage copy,
    its ``output_keys`` / ``tied_head_keys``, its expert numbering and torch_dist renames): a new
    family then needs no edit outside :mod:`reshard.models`."""
    assert family_words_outside_families(_modules()) == []


def test_the_name_check_catches_a_concept_word_in_an_identifier(tmp_path):
    f = tmp_path / "placement.py"
    f.write_text("from reshard.core.rules import MTP_STAGE_COPY as copy\n\n"
                 "def place(entries, mla=None):\n"
                 "    stage_mtp = [e for e in entries if e.holds_nextn]\n"
                 "    return layout(stage_mtp, Mamba=1)\n\n"
                 "class SinksLayout:\n    pass\n")
    assert sorted(family_words_in(f)) == [
        "placement.py:1 import 'MTP_STAGE_COPY'", "placement.py:3 argument 'mla'",
        "placement.py:4 attribute 'holds_nextn'", "placement.py:4 name 'stage_mtp'", "placement.py:5 keyword 'Mamba'",
        "placement.py:5 name 'stage_mtp'", "placement.py:7 definition 'SinksLayout'"]


def test_the_name_check_catches_a_concept_word_in_a_docstring(tmp_path):
    f = tmp_path / "plan.py"
    f.write_text('"""Plans."""\n\ndef collect(stages):\n    """Numbers the layers (not the MTP layers)."""\n'
                 '    # a comment may say MTP\n    return stages\n')
    assert family_words_in(f) == ["plan.py:4 string 'Numbers the layers (not the MTP layers).'"]


def test_the_name_check_catches_a_parameter_name_in_a_format_module(tmp_path):
    """A format module is checked as the core is, a name in code or in prose alike."""
    f = tmp_path / "torch_dist.py"
    f.write_text('"""Stacks ``decoder.layers``."""\nLAYERS = "decoder.layers."\nOK = "layers."\n')
    modules = {"reshard.formats.torch_dist": f, "reshard.models.megatron_gpt": f}  # the family's own: exempt
    assert family_words_outside_families(modules) == ["torch_dist.py:1 string 'Stacks ``decoder.layers``.'",
                                                      "torch_dist.py:2 string 'decoder.layers.'"]


# -- no module reaches into another module's private names ---------------------------------------------
ROOT = PACKAGE.parent
#: Folders of helper modules imported by their file names (``from mcore_fixtures import ...``,
#: ``import bench_fp8``): the tests' and the benchmarks'.
HELPER_FOLDERS = ("tests", "bench")
#: The calls that reach a module's name given as a string (``monkeypatch.setattr(engine, "_x", ...)``).
_BY_NAME = ("setattr", "getattr", "delattr", "hasattr")


def project_modules() -> dict[str, Path]:
    """Every module of the project under the name it is imported by: the package's, and the tests'
    and benchmarks' helper modules."""
    out = _modules()
    for folder in HELPER_FOLDERS:
        out |= {f.stem: f for f in sorted((ROOT / folder).glob("*.py"))}
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str | None:
    """The module ``from ... import`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else [])) or None


def private_uses(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Where ``path`` (the module ``module``) uses another project module's private (``_name``)
    module-level names: imports one (``from reshard.x import _y``), reads one through a module
    object (``x._y``, ``reshard.x._y``) or reaches one by name (``monkeypatch.setattr(x, "_y", v)``,
    ``monkeypatch.setattr("reshard.x._y", v)``). Attributes of an object or a class (``self._y``,
    ``display._rich``, ``Destination._lock``) are not a module's names and not looked at. A name
    counts as a module wherever it is bound to one by an import in the file (functions included)."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # a name in this file -> the module of ours an import binds it to
    found: list[tuple[int, str]] = []
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                bound[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path)
            for a in node.names:
                if source in modules and _private(a.name):
                    found.append((node.lineno, f"from {source} import {a.name}"))
                elif f"{source}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{source}.{a.name}"

    def module_of(expr: ast.AST) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id) if bound.get(expr.id) in modules else None
        if isinstance(expr, ast.Attribute):
            outer = module_of(expr.value)
            return f"{outer}.{expr.attr}" if outer and f"{outer}.{expr.attr}" in modules else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and (owner := module_of(node.value)):
            found.append((node.lineno, f"{owner}.{node.attr}"))
        elif isinstance(node, ast.Call) and node.args and \
                (node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)) in _BY_NAME:
            first, second = node.args[0], node.args[1] if len(node.args) > 1 else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):  # "reshard.x._y"
                owner, _, name = first.value.rpartition(".")
            else:
                owner = module_of(first) or ""
                name = second.value if isinstance(second, ast.Constant) and isinstance(second.value, str) else ""
            if owner in modules and _private(name):
                found.append((node.lineno, f"{owner}.{name} (by name)"))
    return [f"{where}:{line} {what}" for line, what in sorted(found)]


def test_no_module_uses_another_modules_private_names():
    """A name shared between modules is public (documented, kept stable); a private one may
    change with its module alone. Tests included: they use the same public names."""
    modules = project_modules()
    assert [hit for name, path in modules.items() for hit in private_uses(name, path, modules)] == []


def test_the_private_name_check_catches_each_way_in_and_nothing_else(tmp_path):
    f = tmp_path / "user.py"
    f.write_text(
        "import reshard.core.foreign\n"
        "import reshard.execution.engine as eng\n"
        "from reshard.core import zero_master\n"
        "from reshard.core.torch_writer import _Stage, save, __doc__\n"
        "from helper import _shared\n"
        "import torch\n"
        "def f(monkeypatch, self, display, Destination):\n"
        "    from reshard.formats import hf\n"
        "    reshard.core.foreign._Pickler\n"
        "    eng._owned(zero_master.optimizer_state)\n"
        "    monkeypatch.setattr(hf, '_FP8_CHUNK_BYTES', 1)\n"
        "    monkeypatch.setattr('reshard.execution.engine._owned', None)\n"
        # not a module's names: an object's, a class's, a third party's, a module's dunder, a public one
        "    self._x, display._rich, torch._utils, hf.__file__, hf.HFFormat\n"
        "    monkeypatch.setattr(Destination, '_write_lock', None)\n")
    modules = {name: tmp_path / "m.py" for name in (
        "reshard", "reshard.core", "reshard.core.foreign", "reshard.core.zero_master", "reshard.core.torch_writer",
        "reshard.execution", "reshard.execution.engine", "reshard.formats", "reshard.formats.hf", "helper")}
    assert private_uses("user", f, modules) == [
        "user.py:4 from reshard.core.torch_writer import _Stage",
        "user.py:5 from helper import _shared",
        "user.py:9 reshard.core.foreign._Pickler",
        "user.py:10 reshard.execution.engine._owned",
        "user.py:11 reshard.formats.hf._FP8_CHUNK_BYTES (by name)",
        "user.py:12 reshard.execution.engine._owned (by name)",
    ]


def test_a_relative_import_of_a_private_name_is_caught(tmp_path):
    f = tmp_path / "s3_destination.py"
    f.write_text("from .destination import _record\nfrom . import destination\ndestination._record\n")
    modules = {"reshard.storage": f, "reshard.storage.destination": f, "reshard.storage.s3_destination": f}
    assert private_uses("reshard.storage.s3_destination", f, modules) == [
        "s3_destination.py:1 from reshard.storage.destination import _record",
        "s3_destination.py:3 reshard.storage.destination._record"]
