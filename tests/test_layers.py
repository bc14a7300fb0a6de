"""The package's import structure, read from the source: layers import downwards only, the DCP and train
layers reach the engine through ``deltackpt.store``'s public names, no package imports another's private
names, and the benchmark package has no import loop and never calls back into the CLI."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "deltackpt"

# Lower layers never import higher ones (docs: GUIDE section 1); the package root and __main__ are entry points.
LAYERS = {"errors": 0, "settings": 0, "kernels": 0, "_native": 0, "store": 1, "dcp": 2, "train": 3, "interop": 3,
          "bench": 4, "cli": 5}


def _module_of(path: pathlib.Path) -> tuple[str, str]:
    """(module, package) names of a source file under the repository root."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def _is_package(name: str) -> bool:
    return (ROOT.joinpath(*name.split(".")) / "__init__.py").exists()


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists() or any(
        base.parent.glob(base.name + ".*.so"))


def imports(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(target module, imported name or '', line) of every import in ``path``, function-level ones included;
    ``from pkg import submodule`` counts as an import of the submodule."""
    _, package = _module_of(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, "", node.lineno) if _is_module(sub) else (base, a.name, node.lineno))
    return out


def _sources(*dirs: str) -> list[pathlib.Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if parts[0] == "deltackpt" and len(parts) > 1 else None


def test_the_import_reader_sees_known_edges():
    edges = {(t, n) for t, n, _ in imports(PKG / "dcp" / "api.py")}
    assert ("deltackpt.store", "LATEST") in edges and ("deltackpt.dcp.writer", "DeltaStorageWriter") in edges
    assert ("deltackpt.settings", "") in {(t, n) for t, n, _ in imports(PKG / "store" / "basecache.py")}


def test_layers_import_downwards_only():
    bad = []
    for path in _sources("deltackpt"):
        module, _ = _module_of(path)
        mine = _layer(module)
        if mine is None:
            continue  # deltackpt/__init__.py, __main__.py: entry points
        for target, name, line in imports(path):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("layer", ["dcp", "train", "interop"])
def test_dcp_train_and_interop_use_only_the_public_store_names(layer):
    import deltackpt.store

    bad = []
    for path in _sources(f"deltackpt/{layer}"):
        for target, name, line in imports(path):
            if target.startswith("deltackpt.store") and (target != "deltackpt.store"
                                                         or name not in deltackpt.store.__all__):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} {name}".rstrip())
    assert not bad, "\n".join(bad)


def test_no_private_names_across_packages():
    bad = []
    for path in _sources("deltackpt", "benchmarks"):
        _, package = _module_of(path)
        for target, name, line in imports(path):
            private = name if name else target.rsplit(".", 1)[-1]
            if not target.startswith("deltackpt") or not private.startswith("_") or private.startswith("__"):
                continue
            owner = target if name else target.rsplit(".", 1)[0]  # the module the private name belongs to
            owner_package = owner if _is_package(owner) else owner.rsplit(".", 1)[0]
            if target == "deltackpt._native" and package == "deltackpt.kernels":
                continue  # the C extension is the kernels package's own half (the build fixes its import name)
            if owner_package != package:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {owner}")
    assert not bad, "\n".join(bad)


def test_bench_has_no_import_loop_and_never_imports_the_cli():
    graph: dict[str, set[str]] = {}
    for path in _sources("deltackpt/bench"):
        module, _ = _module_of(path)
        targets = {t for t, _, _ in imports(path)}
        assert not any(t == "deltackpt.cli" or t.startswith("deltackpt.cli.") for t in targets), module
        graph[module] = {t for t in targets if t.startswith("deltackpt.bench.") and t != module}

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import loop: " + " -> ".join(path[path.index(node):] + [node]))
        for nxt in graph.get(node, ()):
            visit(nxt, path + [node])

    for module in graph:
        visit(module, [])
    assert "deltackpt.bench.__main__" not in graph  # `deltackpt bench` is the command line
