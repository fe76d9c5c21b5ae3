"""The package's folders are layers, and imports run only downwards: entrypoints -> engine ->
loaders -> text -> model -> host (README.md, "Layout")."""

import ast
from pathlib import Path

import tinyllm

LAYERS = ["host", "model", "text", "loaders", "engine", "entrypoints"]  # lowest first
PACKAGE = Path(tinyllm.__file__).parent


def upward_imports() -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        folder = path.relative_to(PACKAGE).parts[0]
        if folder not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinyllm."):
                target = node.module.split(".")[1]
                if target in LAYERS and LAYERS.index(target) > LAYERS.index(folder):
                    found.append(f"{path.relative_to(PACKAGE)} imports {node.module}")
    return found


def test_every_folder_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS)


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports() == []
