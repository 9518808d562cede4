"""Lower layers never import upper ones: the engine's parts below the engine core (scheduler, runner, model,
sampler, speculation, grammars) import nothing from the engine, the server, the router or the benchmarks."""

import ast
import pathlib

import llmserve

SRC = pathlib.Path(llmserve.__file__).parent
LOWER = ("core", "worker", "model", "sample", "spec", "structured")
UPPER = ("engine", "server", "router", "bench", "rayserve")


def _imported_modules(path: pathlib.Path, is_top_level_only: bool = False) -> list[str]:
    """What a module imports; is_top_level_only: only what it imports when it is imported (not in functions)."""
    tree = ast.parse(path.read_text())
    names = []
    for node in (tree.body if is_top_level_only else ast.walk(tree)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_lower_layers_import_no_upper_layer():
    offending = [f"{path.relative_to(SRC)} imports {name}"
                 for layer in LOWER for path in sorted((SRC / layer).rglob("*.py"))
                 for name in _imported_modules(path)
                 if name.split(".")[:2] in [["llmserve", upper] for upper in UPPER]]
    assert not offending, offending


def test_speculation_imports_nothing_from_the_runner():
    """The runner holds the speculator (worker -> spec), so spec/ may not import worker/ (a cycle)."""
    offending = [f"{path.relative_to(SRC)} imports {name}"
                 for path in sorted((SRC / "spec").rglob("*.py")) for name in _imported_modules(path)
                 if name.split(".")[:2] == ["llmserve", "worker"]]
    assert not offending, offending


def test_serving_imports_no_test_scaffolding():
    """Checkpoint makers, toy tokenizers, test servers and the step gate live in llmserve.testing; no serving
    package loads them with itself (the demo model and the step gate import them when they are asked for)."""
    serving = LOWER + ("engine", "server", "router", "rayserve")
    offending = [f"{path.relative_to(SRC)} imports {name}"
                 for layer in serving for path in sorted((SRC / layer).rglob("*.py"))
                 for name in _imported_modules(path, is_top_level_only=True) if name.split(".")[:2] == ["llmserve", "testing"]]
    assert not offending, offending
