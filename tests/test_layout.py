"""The house rules a test can hold: no import cycles; kernels/ a leaf; LLAMACTL_* read in one module."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llamactl"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports() -> dict[str, set[str]]:
    """Every llamactl module each module imports, at the top or inside a function, with the
    packages an import runs (importing a.b.c runs a/__init__ and a/b/__init__)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                parts = name.split(".")
                graph[m].update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in mods)
        graph[m].discard(m)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_there_are_no_import_cycles():
    assert _cycles(_imports()) == []


def test_a_cycle_would_be_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kernels_are_a_leaf_and_layers_sit_on_them():
    graph = _imports()
    allowed = {"llamactl.errors"}
    for m, deps in graph.items():
        if m.startswith("llamactl.kernels"):
            outside = {d for d in deps if not d.startswith("llamactl.kernels") and d != "llamactl"}
            assert outside <= allowed, (m, outside)
        if m.startswith("llamactl.layers"):
            assert not {d for d in deps if d.startswith(("llamactl.quantize", "llamactl.ui", "llamactl.cli",
                                                         "llamactl.runtime.load", "llamactl.runtime.step"))}, m


def test_only_options_reads_llamactl_variables():
    readers = [str(f.relative_to(PACKAGE.parent)) for f in PACKAGE.rglob("*.py")
               if '"LLAMACTL_' in f.read_text() and f.name != "options.py"]
    assert readers == []
    for f in PACKAGE.rglob("*.py"):  # no module sets os.environ for llamactl's switches
        assert "os.environ[\"LLAMACTL" not in f.read_text() and "setenv(\"LLAMACTL" not in f.read_text(), f


def test_building_a_decoder_changes_no_inductor_setting(tiny_gqa):
    import torch._inductor.config as inductor_config
    import torch

    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.runtime.load import load_model

    before = dict(inductor_config.get_config_copy())
    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    Decoder(model, 1, 32, "compile")
    assert dict(inductor_config.get_config_copy()) == before


# Floors of the house, the ground first: a module imports only from its own floor or below.
FLOORS = [("llamactl", "llamactl.errors", "llamactl.ui"), ("llamactl.kernels",), ("llamactl.options",),
          ("llamactl.folder",), ("llamactl.layers", "llamactl.runtime"),
          ("llamactl.quality", "llamactl.compile", "llamactl.quantize", "llamactl.convert", "llamactl.gqa"),
          ("llamactl.bench",), ("llamactl.serve",), ("llamactl.cli", "llamactl.completions", "llamactl.__main__")]


def _floor(module: str) -> int:
    """The floor of the longest FLOORS name that is module or a package above it."""
    best = max(((len(n), i) for i, names in enumerate(FLOORS) for n in names
                if module == n or module.startswith(n + ".")), default=None)
    assert best is not None, f"{module} has no floor in FLOORS"
    return best[1]


def test_no_module_imports_one_above_it():
    upward = [(m, d) for m, deps in _imports().items() for d in deps if _floor(d) > _floor(m)]
    assert upward == []


def test_an_upward_import_would_be_found():
    assert _floor("llamactl.runtime.load") < _floor("llamactl.quantize.formats")
    assert _floor("llamactl.serve.engine") > _floor("llamactl.bench.targets") > _floor("llamactl.quantize.rtn")


def test_the_scheduler_imports_no_torch():
    """The scheduler with its block pool and the sampling-settings type, alone."""
    for module, allowed in (("serve/scheduler", {"llamactl.serve.blocks", "llamactl.serve.plan"}),
                            ("serve/plan", {"llamactl.runtime.settings"}), ("serve/blocks", set()),
                            ("runtime/settings", set())):
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n.split(".")[0] in ("torch", "numpy", "triton")}, names
        assert not {n for n in names if n.startswith("llamactl")} - allowed, names


def test_the_model_holds_no_cache_tensors(tiny_gqa):
    import torch

    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.load import load_model
    from llamactl.runtime.step import Decoder

    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    dec = Decoder(model, 2, 32)
    dec.prefill(torch.tensor([[1, 2, 3]]), slot=1)
    assert {n for n, _ in model.named_buffers()} == {"rope_cos", "rope_sin", "causal_mask"}
    assert len(dec.cache.layers) == model.args.num_hidden_layers
    assert dec.cache.layers[0].k.shape == (2, model.args.num_key_value_heads, 32, model.args.head_dim)
    assert dec.cache.layers[0].k[1, :, :3].abs().sum() > 0 and dec.cache.layers[0].k[0].abs().sum() == 0
