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
    return {m: {i for i in imports_of(p, modules) if i in modules and i != m and i != "reshard"}
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


# -- a model family's parameter names are spelled in its own module ------------------------------------
#: Fragments of the built-in families' parameter names (Megatron-LM legacy, megatron-core, Hugging Face).
FAMILY_NAMES = re.compile(r"local_experts|linear_(?:fc[12]|qkv|proj)|self_attention|query_key_value|dense_h_to_4h|"
                          r"dense_4h_to_h|word_embeddings|output_layer|language_model\.|decoder\.|model\.layers|"
                          r"shared_experts|q_proj|gate_proj|embed_tokens")
#: Packages that ask the families and never name a parameter themselves.
NAME_FREE = ("reshard.core", "reshard.execution")


def family_names_in(path: Path) -> list[str]:
    """The string literals of ``path`` that spell a family's parameter names (docstrings, which
    describe layouts, are prose and exempt)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [f"{path.name}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and FAMILY_NAMES.search(node.value)]


def test_the_core_and_the_planner_spell_no_family_parameter_names():
    """They ask the family (its rule flags, its ``output_keys`` / ``tied_head_keys``, its expert
    numbering): a new family then needs no edit below it."""
    found = [hit for name, path in _modules().items() if name.startswith(NAME_FREE) for hit in family_names_in(path)]
    assert found == []


def test_the_name_check_catches_a_name_in_code_but_not_in_a_docstring(tmp_path):
    f = tmp_path / "placement.py"
    f.write_text('"""Places ``output_layer.weight`` last."""\n\ndef f(k):\n    """On ``decoder.layers``."""\n'
                 '    return k.startswith("output_layer.")\n')
    assert family_names_in(f) == ["placement.py:5 'output_layer.'"]
