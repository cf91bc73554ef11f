"""Data flows one way: a module imports from its own layer and the ones below, never from above (the table of
layers is docs/development.md's "The package by layer"). Each part's own settings (its config.py, and the presets
that fill them) belong to the bottom layer, since the run's config composes them all. And what the package's users
in this repository (benches, tools, tests, launchers) import from it exists: a moved name fails here, not in a bench
that no test runs."""

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "megatron_dapo"
LAYERS = {
    1: ("config", "run_config", "config_reference", "errors", "user_files", "samples", "ops", "data",
        "observability", "_C"),
    2: ("policy", "reward", "tool", "parallel"),
    3: ("checkpoint", "algorithm"),
    4: ("rollout", "weight_sync"),
    5: ("service",),
    6: ("loop", "trainer", "slurm", "cli", "demo", "preflight", "mismatch_check"),
}
LAYER_OF = {part: layer for layer, parts in LAYERS.items() for part in parts}
SETTINGS = {("algorithm", "presets")}  # besides each part's config.py


def layer(module: tuple[str, ...]) -> int:
    """The layer of megatron_dapo.<module...>."""
    if len(module) > 1 and (module[-1] == "config" or module[:2] in SETTINGS):
        return 1
    return LAYER_OF[module[0]]


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megatron_dapo."):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("megatron_dapo."))


def test_every_top_level_part_has_a_layer():
    parts = {p.stem if p.suffix == ".py" else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert parts <= set(LAYER_OF), \
        f"give these a layer in LAYERS (and docs/development.md): {sorted(parts - set(LAYER_OF))}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.relative_to(PACKAGE).with_suffix("").parts
        if source[-1] == "__init__":
            source = source[:-1]
        if not source:
            continue
        for line, name in imports(path):
            target = tuple(name.split(".")[1:])
            if layer(target) > layer(source):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} (layer {layer(source)}) imports {name} "
                              f"(layer {layer(target)})")
    assert not upward, "\n".join(upward)


def test_every_name_the_benches_tools_and_tests_import_from_the_package_exists():
    missing = []
    for path in sorted(p for folder in ("bench", "tools", "tests", "launch") for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0
                    and (node.module or "").startswith("megatron_dapo")):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            try:
                module = importlib.import_module(node.module)
            except ModuleNotFoundError as error:
                missing.append(f"{where}: {error}")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:  # a submodule, imported by name
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{where}: {node.module} has no {alias.name}")
    assert not missing, "\n".join(missing)
