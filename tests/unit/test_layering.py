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


# The Ray Serve modules that configure and run an engine replica (the replica serves our server's app over
# its own engine); the rest of rayserve/ (ingress, request router, ASGI bridge) runs no engine.
RAYSERVE_ENGINE_SIDE = ("rayserve/replica.py", "rayserve/config.py", "rayserve/cli.py")


def _imports_of(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return [f"{path.relative_to(SRC)} imports {name}"
            for path in sorted((SRC / package).rglob("*.py")) if path.relative_to(SRC).as_posix() not in allowed
            for name in _imported_modules(path) if name.split(".")[:2] in [["llmserve", f] for f in forbidden]]


def test_shared_http_pieces_import_no_other_package():
    """http/ sits below the server, the router and Ray Serve: it imports none of our packages."""
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()} - {"http"}
    assert not _imports_of("http", tuple(packages))


def test_router_and_ingress_import_neither_server_nor_engine():
    """The router and Ray Serve's ingress share HTTP pieces through http/, so they load without the engine."""
    assert not _imports_of("router", ("server", "engine"))
    assert not _imports_of("rayserve", ("server", "engine"), allowed=RAYSERVE_ENGINE_SIDE)


def test_the_router_and_the_ingress_load_without_server_engine_or_torch():
    """What they load, not only what they name: nothing below them pulls the server, the engine or torch in."""
    import subprocess
    import sys

    code = ("import sys, llmserve.router.server, llmserve.router.app, llmserve.rayserve.ingress\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['llmserve', 'server'], "
            "['llmserve', 'engine']) or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
