"""Structure of the hp_tool package, measured from its source: where model-family knowledge lives, the
import graph's cycles, function-level imports, the types that describe a parallel layout, the busiest
module's internal imports, how many files name each searched dimension, the engine-name branches outside
the engine registry and the family module-name literals in trial code outside ``hp_tool/trial/families/``.

    python benchmarks/architecture_metrics.py [--list]

Family branches: comparisons of a family name (``family ==``/``!=``/``in``, a family literal such as
"llama" compared to anything, or a use of an encoder-decoder name list) outside the registry folders
``hp_tool/families/`` and ``hp_tool/trial/families/``. Import cycles: strongly connected components of
the graph of every internal import, module-level and function-level (a function-level import that dodges
a cycle is still the cycle). Layout types: classes that carry both a ``tp`` and a ``pp`` integer field. Dimension files: files of
hp_tool whose code names a searched dimension (``hp_tool/dimensions.py``'s rows) as a word, comments and
docstrings aside. Engine branches: comparisons of an engine (``engine ==``/``!=``) or with an engine's
name ("torch"/"deepspeed" compared to anything) outside ``hp_tool/trial/engines/``; the rules read
``hp_tool/engine_facts.py`` instead.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hp_tool"
REGISTRY_DIRS = (PKG / "families", PKG / "trial" / "families")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from family_literals import STAGE_PARTS, module_name_literals  # noqa: E402
from hp_tool.dimensions import DIMENSIONS  # noqa: E402
from hp_tool.families import family_names  # noqa: E402

FAMILY_NAMES = tuple(family_names())
ENGINE_DIR = PKG / "trial" / "engines"
ENGINE_BRANCH = re.compile(r"\bengine\s*(==|!=)|(==|!=|\bin\b)\s*\(?[\"'](torch|deepspeed)[\"']|"
                           r"[\"'](torch|deepspeed)[\"']\s*(==|!=|\bin\b)")
FAMILY_BRANCH = re.compile(r"\bfamily\b[\w.\]\)]*\s*(==|!=|\bin\b|\bnot in\b)|ENCODER_DECODER|"
                           r"(==|!=)\s*[\"'](" + "|".join(FAMILY_NAMES) + r")[\"']|"
                           r"[\"'](" + "|".join(FAMILY_NAMES) + r")[\"']\s*(==|!=|\bin\b)")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "conf" not in p.relative_to(PKG).parts[:1]}


def resolve(mod: str, node: ast.ImportFrom | ast.Import, known: set[str], is_pkg: bool) -> list[str]:
    """Internal modules an import statement names."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = mod.split(".")
            parts = parts if is_pkg else parts[:-1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        subs = [f"{base}.{a.name}" if base else a.name for a in node.names]
        names = [n for n in subs if n in known] or [base]
    out = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != mod:
            out.append(name)
    return sorted(set(out))


def import_graph(mods: dict[str, Path]) -> tuple[dict[str, set[str]], int, dict[str, int]]:
    """(module -> internal modules it imports, function-level import count, files with them). Type-only imports
    (under ``if TYPE_CHECKING``) are edges too: a module naming another's type depends on it."""
    known = set(mods)
    graph: dict[str, set[str]] = defaultdict(set)
    nested, nested_files = 0, defaultdict(int)
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        top = set(id(n) for n in tree.body)
        type_checking = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                type_checking.update(id(c) for c in ast.walk(n))
        for n in ast.walk(tree):
            if not isinstance(n, (ast.Import, ast.ImportFrom)):
                continue
            targets = resolve(mod, n, known, is_pkg)
            graph[mod].update(targets)
            if id(n) not in top and id(n) not in type_checking and targets:
                nested += 1
                nested_files[mod] += 1
    return graph, nested, dict(nested_files)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), ignoring package __init__
    re-export edges from a package to its own submodules."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def edges(v):
        return [w for w in graph.get(v, ()) if not w.startswith(v + ".")]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def family_branches(mods: dict[str, Path]) -> list[str]:
    hits = []
    for mod, path in mods.items():
        if any(path.is_relative_to(d) for d in REGISTRY_DIRS):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if FAMILY_BRANCH.search(code) and not code.strip().startswith(("\"", "'")):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    return hits


# Floors of the package, bottom first: a module may import its own floor and those below. The trial engine
# sits on top with the entry points: only the launcher's job, the memory-check workers, the inference
# worker and benchmarks reach into it.
FLOORS = (
    ("vocabulary and contracts", ("hp_tool.errors", "hp_tool.registry", "hp_tool.fsutil", "hp_tool.fingerprint", "hp_tool.vocab",
                                  "hp_tool.cost", "hp_tool.tables", "hp_tool.recipe", "hp_tool.dimensions", "hp_tool.words",
                                  "hp_tool.engine_facts")),
    ("model facts", ("hp_tool.throughput", "hp_tool.families", "hp_tool.architectures", "hp_tool.sizing", "hp_tool.sharding",
                     "hp_tool.layout", "hp_tool.estimate")),
    ("contracts", ("hp_tool.contracts", "hp_tool.config", "hp_tool.wandb_key", "hp_tool.hf_config")),
    ("planning", ("hp_tool.candidates", "hp_tool.planner", "hp_tool.base_config", "hp_tool.calibration",
                  "hp_tool.adaptive", "hp_tool.inference.grid", "hp_tool.plan_output")),
    ("results and launching", ("hp_tool.results", "hp_tool.launch", "hp_tool.deepspeed_ops", "hp_tool.inference.report",
                               "hp_tool.compare")),
    ("orchestration", ("hp_tool.tracking", "hp_tool.memory_check", "hp_tool.search", "hp_tool.session", "hp_tool.adaptive_gate",
                       "hp_tool.inference.search", "hp_tool.inference")),
    ("engine and entry", ("hp_tool.trial", "hp_tool.trial.inference_worker", "hp_tool.cli", "hp_tool.__main__",
                          "hp_tool")),
)


def floor_of(mod: str) -> int:
    best, floor = -1, len(FLOORS)
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), i
    return floor


# The doors into the engine: the launcher's job runs a trial, the memory check traces the engine's own
# model, the inference search submits its worker.
DOORS = ("hp_tool.launch.job", "hp_tool.memory_check", "hp_tool.inference.search")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a module to one on a higher floor (a lower module depending on its reader), other than
    the doors into the engine."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if floor_of(d) > floor_of(m) and not d.startswith(m + ".")
                  and not (m in DOORS and floor_of(d) == len(FLOORS) - 1))


def folder_of(mod: str, mods: dict[str, Path]) -> str:
    """The folder a module's file sits in, as a package name (hp_tool.results); a module of the package's own
    folder is a folder of its own (hp_tool.candidates): those files are each on their floor."""
    package = mod if mods[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]
    return mod if package == "hp_tool" else package


def folder_graph(graph: dict[str, set[str]], mods: dict[str, Path]) -> dict[str, set[str]]:
    """The import graph between folders (``folder_of``): an edge where some file of one imports a file of
    another; a folder importing its own files, or a package's files, is no edge."""
    out: dict[str, set[str]] = defaultdict(set)
    for m, deps in graph.items():
        for d in deps:
            a, b = folder_of(m, mods), folder_of(d, mods)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                out[a].add(b)
    return out


def upward_folder_imports(graph: dict[str, set[str]], mods: dict[str, Path]) -> list[str]:
    """Imports from a file to one in a folder on a higher floor than its own folder's (``floor_of`` the folder's
    name), other than the doors into the engine; each file-to-file edge named once."""
    top = len(FLOORS) - 1
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if floor_of(folder_of(d, mods)) > floor_of(folder_of(m, mods))
                  and not folder_of(d, mods).startswith(folder_of(m, mods) + ".")
                  and folder_of(d, mods) != folder_of(m, mods)
                  and not (m in DOORS and floor_of(folder_of(d, mods)) == top))


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, code) of a file with comments and docstrings blanked."""
    text = path.read_text()
    docs = set()
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body and \
                isinstance(n.body[0], ast.Expr) and isinstance(getattr(n.body[0], "value", None), ast.Constant) \
                and isinstance(n.body[0].value.value, str):
            docs.update(range(n.body[0].lineno, n.body[0].end_lineno + 1))
    return [(i, line.split("#", 1)[0]) for i, line in enumerate(text.splitlines(), 1) if i not in docs]


def dimension_files(mods: dict[str, Path]) -> dict[str, list[str]]:
    """Per searched dimension, the files of hp_tool whose code names it."""
    out = {}
    for d in DIMENSIONS:
        word = re.compile(rf"\b{d.name}\b")
        out[d.name] = sorted(str(p.relative_to(ROOT)) for p in mods.values()
                             if any(word.search(code) for _, code in code_lines(p)))
    return out


def engine_branches(mods: dict[str, Path]) -> list[str]:
    hits = []
    for path in mods.values():
        if path.is_relative_to(ENGINE_DIR):
            continue
        hits += [f"{path.relative_to(ROOT)}:{i}: {code.strip()}" for i, code in code_lines(path)
                 if ENGINE_BRANCH.search(code) and not code.lstrip().startswith("for ")]
    return hits


def layout_types(mods: dict[str, Path]) -> list[str]:
    found = []
    for mod, path in mods.items():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ClassDef):
                fields = {t.target.id for t in n.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)
                          and ast.unparse(t.annotation) == "int"}
                if {"tp", "pp"} <= fields:
                    found.append(f"{mod}.{n.name}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every site, cycle and type")
    args = parser.parse_args()
    mods = sources()
    graph, nested, nested_files = import_graph(mods)
    branches = family_branches(mods)
    cyc = cycles(graph)
    layouts = layout_types(mods)
    busiest = max(graph, key=lambda m: len(graph[m]))
    spec_mod = next((m for m in mods if m.endswith(".spec") or m.endswith("trial_spec")), None)
    print(f"modules: {len(mods)}, lines: {sum(len(p.read_text().splitlines()) for p in mods.values())}")
    print(f"family-branch sites outside the registry folders: {len(branches)} in "
          f"{len({b.split(':')[0] for b in branches})} files")
    print(f"import cycles (module-level, function-level and type-only edges): {len(cyc)} by file, "
          f"{len(folder_cyc := cycles(folder_graph(graph, mods)))} by folder")
    ups, folder_ups = upward_imports(graph), upward_folder_imports(graph, mods)
    print(f"imports running back up the floors: {len(ups)} by file, {len(folder_ups)} by folder")
    print(f"function-level imports of hp_tool modules: {nested} in {len(nested_files)} files")
    print(f"types describing a parallel layout (int fields tp and pp): {len(layouts)}")
    print(f"busiest module: {busiest} with {len(graph[busiest])} internal imports")
    importers = [m for m, deps in graph.items() if any(d.endswith(".spec") for d in deps)]
    print(f"modules importing a *.spec module: {len(importers)}")
    engine_users = sorted(m for m, deps in graph.items() if not m.startswith("hp_tool.trial")
                          and any(d.startswith("hp_tool.trial") for d in deps))
    print(f"modules outside hp_tool.trial importing it: {len(engine_users)}")
    dims = dimension_files(mods)
    print("files naming each searched dimension: " + ", ".join(f"{k} {len(v)}" for k, v in dims.items()))
    print(f"dimensions named in at most 6 files: {sum(len(v) <= 6 for v in dims.values())} of {len(dims)}")
    engines = engine_branches(mods)
    print(f"engine-name branches outside hp_tool/trial/engines/: {len(engines)} in "
          f"{len({e.split(':')[0] for e in engines})} files")
    literals = module_name_literals(PKG / "trial")
    parts = sum(literal in STAGE_PARTS for _, _, literal in literals)
    print(f"family module-name literals in trial code outside hp_tool/trial/families/: {len(literals) - parts} "
          f"(besides {parts} of the stage modules' own part names: embed_tokens, lm_head, ...)")
    if args.list:
        print("\n".join(["", "family branches:"] + branches))
        print("\n".join(["", "cycles:"] + [" <-> ".join(c) for c in cyc + folder_cyc]))
        print("\n".join(["", "layout types:"] + layouts))
        print("\n".join(["", "imports running back up:"] + ups + ["by folder:"] + folder_ups))
        print("\n".join(["", "function-level imports per file:"] + [f"{m}: {n}" for m, n in sorted(nested_files.items())]))
        print("\n".join(["", "importers of hp_tool.trial outside it:"] + engine_users))
        print("\n".join(["", "engine-name branches:"] + engines))
        print("\n".join(["", "files naming each dimension:"] + [f"{k}: {' '.join(v)}" for k, v in dims.items()]))


if __name__ == "__main__":
    main()
