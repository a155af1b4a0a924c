"""The package structure README's "Architecture" section describes, checked from the sources.

- one direction of imports: runtime <- comm <- ops/kernels <- tensor_parallel <- optim/data <- models
  <- checkpoint <- train <- plan/bench (a module imports only from its own layer or the layers
  before it);
- no import cycle among cutp's modules, function-local imports counted;
- function-local imports only for optional dependencies, each saying so on its line;
- no module over 500 lines without the reason stated in its docstring.
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# In import order: a module may import from its own layer and the layers before it.
LAYERS = [
    ("runtime", ["cutp.runtime"]),
    ("comm", ["cutp.comm"]),
    ("ops/kernels", ["cutp.ops", "cutp.kernels"]),
    ("tensor_parallel", ["cutp.tensor_parallel"]),
    ("optim/data", ["cutp.optim", "cutp.data"]),
    ("models", ["cutp.models", "cutp.hf", "cutp.generate"]),
    ("checkpoint", ["cutp.checkpoint"]),
    ("train", ["cutp.train"]),
    ("plan/bench/tools", ["cutp.plan", "cutp.bench", "cutp.info", "cutp.__main__"]),
]
# Imported inside functions because the package may be missing or broken on a machine that
# still runs cutp (CuPy and NVIDIA's wheels without a GPU, torch/transformers for comparisons,
# matplotlib for plots, tokenizers for model tokenizers).
OPTIONAL = {"cupy", "cupyx", "nvidia", "torch", "transformers", "matplotlib", "tokenizers", "tensorboardX", "jinja2"}
# `python -m cutp info` reports a broken MPI instead of failing to start.
LATE_ALLOWED = {("cutp.info", "mpi4py")}
# another project's private module, each with its reason: TorchDispatchMode (the only way to time
# torch's aten.mm calls, backward's included, without torch.profiler's lines on stderr; torch's
# own FlopCounterMode is built on it), compare-torch's GEMM split, which goes without it if it moves
PRIVATE_ALLOWED = {("cutp.bench.compare_torch", "torch.utils._python_dispatch")}
MAX_LINES = 500


def _module_files():
    out = {}
    for path in sorted((ROOT / "cutp").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        rel = path.relative_to(ROOT / "kernels").with_suffix("")
        name = ".".join(("cutp", "kernels") + rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _module_files()


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _resolve(module, node):
    """Absolute names a (from-)import statement in `module` refers to."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".")
        if not _is_package(module):
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module
    names = []
    for a in node.names:
        full = f"{prefix}.{a.name}"
        names.append(full if full in MODULES else prefix)
    return names


def _imports(name):
    """[(target, line, in_function)] for every import statement of module `name`."""
    tree = ast.parse(MODULES[name].read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _resolve(name, child):
                    found.append((target, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def _lazy_imports(name):
    """cutp modules a module loads by name (importlib.import_module of a string written in it:
    the PEP 562 facades, the command table of `python -m cutp`)."""
    tree = ast.parse(MODULES[name].read_text())
    if not any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree)):
        return []
    return sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in MODULES})


def _names_from_the_package(name):
    """Names a module takes from the package `cutp` itself (`from .. import __version__`)."""
    tree = ast.parse(MODULES[name].read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _resolve(name, node) and all(t == "cutp" for t in _resolve(name, node)):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Import) and any(a.name == "cutp" for a in node.names):
            names.add("*")
    return names


def _cutp_module(target):
    """The cutp module a target names (itself, or the nearest enclosing module)."""
    parts = target.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _layer(name):
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


GRAPH = {m: sorted({t for t in (_cutp_module(t) for t, _, _ in _imports(m)) if t and t != m} | set(_lazy_imports(m)))
         for m in MODULES}


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if m != "cutp" and _layer(m) is None]
    assert not missing, f"modules outside the layers of README's architecture: {missing}"


def test_imports_go_one_direction():
    wrong = []
    for m, targets in GRAPH.items():
        if m == "cutp":
            continue  # the package facade re-exports from the runtime and loads the Context lazily
        for t in targets:
            if t == "cutp" or _layer(t) is None:
                continue
            if _layer(t) > _layer(m):
                wrong.append(f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_only_the_top_takes_names_from_the_package_facade():
    """Below bench, a module imports from the package `cutp` only its version (the facade loads
    the Context lazily; anything else would hide an upward import)."""
    top = _layer("cutp.bench")
    wrong = {m: sorted(n) for m in MODULES if m != "cutp" and _layer(m) < top
             for n in [_names_from_the_package(m) - {"__version__"}] if n}
    assert not wrong, wrong


def test_no_import_cycles():
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "active"
        stack.append(m)
        for t in GRAPH[m]:
            if t == "cutp" or (m.startswith(t + ".") and _is_package(t)):
                continue  # a submodule's package (its __init__) runs before it anyway
            if state.get(t) == "active":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_function_local_imports_are_optional_dependencies_and_say_so():
    wrong = []
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        for target, line, in_function in _imports(m):
            if not in_function:
                continue
            top = target.split(".")[0]
            text = lines[line - 1] + " " + (lines[line - 2] if line > 1 else "")
            if (m, top) in LATE_ALLOWED:
                continue
            if top not in OPTIONAL:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {target} is imported inside a function")
            elif "optional" not in text:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: import of {target} does not say it is optional")
    assert not wrong, "\n".join(wrong)


def test_no_module_over_500_lines_without_a_reason():
    long = []
    for m, path in MODULES.items():
        text = path.read_text()
        n = len(text.splitlines())
        if n <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not re.search(r"\b(over|longer than|more than) 500 lines\b", doc):
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, "modules over 500 lines whose docstring does not say why:\n" + "\n".join(long)


@pytest.mark.parametrize("package", ["cutp.runtime", "cutp.comm"])
def test_lower_packages_import_nothing_above_them(package):
    mine = _layer(package)
    for m in MODULES:
        if m == package or m.startswith(package + "."):
            assert all(_layer(t) is None or _layer(t) <= mine for t in GRAPH[m] if t != "cutp"), (m, GRAPH[m])


def test_the_checker_sees_local_imports_and_cycles():
    """The checks above would fail on what they look for (guards against a checker that sees nothing)."""
    assert ("cupy", True) in {(t.split(".")[0], f) for t, _, f in _imports("cutp.runtime.backend")}
    assert "cutp.runtime.errors" in GRAPH["cutp.runtime.backend"]
    assert "cutp.runtime.watchdog" in GRAPH["cutp.runtime.failure"]
    assert "cutp.comm.context" in GRAPH["cutp"] and "cutp.info" in GRAPH["cutp.__main__"]  # loaded by name
    assert _names_from_the_package("cutp.comm.context") == {"__version__"}


@pytest.mark.parametrize("path", ["examples/train_gpt.py", "cutp/bench/model.py"])
def test_the_script_and_the_benchmark_run_the_librarys_step(path):
    """One training step for every caller: neither keeps a copy of its parts or of its watchdog."""
    tree = ast.parse((ROOT / path).read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "train_step" in called
    copies = called & {"finish_grad_sync", "global_grad_norm", "clip_scale", "lr_schedule", "zero_grad", "guard",
                       "backward", "Allreduce"}
    assert not copies, f"{path} does itself what cutp.train.train_step does: {sorted(copies)}"


def test_no_private_name_is_imported_across_modules():
    """What another module needs is public: no `from x import _name`, no private module imported
    (kernels/ and cutp/ alike)."""
    wrong = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if node.module and any(p.startswith("_") and not p.startswith("__") for p in node.module.split(".")) \
                    and (m, node.module) not in PRIVATE_ALLOWED:
                private.append(f"(module {node.module})")
            if private:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {', '.join(private)}")
    assert not wrong, "private names imported across modules:\n" + "\n".join(wrong)
