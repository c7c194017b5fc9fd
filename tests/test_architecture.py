"""The shape of the code (shared/ARCHITECTURE.md): every import, module-level or inside a function,
read from the source with ``ast``. No import circles among toolkit modules; only the adapters and
the compatibility layers import DeepSpeed or megatron-core; the loop knows no model family; every
constant has one home; modules stay short enough to read."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.conftest import REPO

TOOLKIT = REPO / "toolkit"
BACKENDS = ("deepspeed", "megatron")
MAX_LINES = 500


def modules() -> dict[str, Path]:
    out = {}
    for path in TOOLKIT.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, name: str, known: dict) -> set[str]:
    """Modules ``path`` imports: toolkit modules (a ``from pkg import submodule`` counts the
    submodule, not the package) and the top-level names of others."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}"
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found.update(subs if len(subs) == len(node.names) else [base, *subs])
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for name, path in known.items():
        targets = set()
        for imported in imports(path, name, known):
            while imported and imported not in known and imported.startswith("toolkit"):
                imported = imported.rpartition(".")[0]
            if imported.startswith("toolkit") and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_among_toolkit_modules():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_adapters_and_compat_import_the_backends():
    known = modules()
    offenders = {name: sorted(m for m in imports(path, name, known) if m.split(".")[0] in BACKENDS)
                 for name, path in known.items()
                 if not name.startswith(("toolkit.adapters", "toolkit.compat"))}
    assert {n: m for n, m in offenders.items() if m} == {}


def test_lora_lives_in_its_room_or_beside_a_backend():
    """LoRA code is ``toolkit/lora/`` (and the backend-specific parts in ``toolkit/adapters/``): only
    those import peft or name a module after LoRA, and only ``toolkit/lora/`` calls peft's
    ``get_peft_model`` (the one skeleton, ``apply_lora``, the converter's reference)."""
    known = modules()
    home = ("toolkit.lora", "toolkit.adapters")
    peft_users = sorted(n for n, p in known.items() if "peft" in {m.split(".")[0] for m in imports(p, n, known)})
    assert [n for n in peft_users if not n.startswith(home)] == []
    assert [n for n in known if "lora" in n.rsplit(".", 1)[-1] and not n.startswith(home)] == []
    assert [n for n, p in known.items() if "get_peft_model(" in p.read_text() and not n.startswith("toolkit.lora")] == []


def test_one_builder_of_the_meta_model():
    """The HF model on the meta device is built in one place (``families/meta.py``), so the plan,
    the engines, peft's skeleton and the converter see the same model (tied weights tied)."""
    builders = {name for name, path in modules().items() if "from_config(" in (text := path.read_text())
                and ("init_empty_weights(" in text or 'torch.device("meta")' in text)}
    assert builders == {"toolkit.families.meta"}


def test_the_plan_imports_no_estimator():
    """``toolkit/plan/`` is config -> layout -> plan.json; the estimate reads the plan, not the reverse."""
    known = modules()
    assert {name: sorted(m for m in imports(path, name, known) if m.startswith("toolkit.estimate"))
            for name, path in known.items() if name.startswith("toolkit.plan")} == \
        {name: [] for name in known if name.startswith("toolkit.plan")}


def test_the_loop_knows_no_model_family():
    known = modules()
    for name, path in known.items():
        if name.startswith("toolkit.train"):
            assert not any(m.startswith("toolkit.families") for m in imports(path, name, known)), name


def test_every_constant_has_one_home():
    """Module-level UPPER_CASE names defined in two modules are one value written twice (or two
    meanings under one name); re-exports (imports) do not count, nor ``FAMILY``, which every
    family file defines by convention (that is how families are discovered)."""
    defined = Counter()
    for path in modules().values():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            defined.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper() and len(t.id) > 1)
    assert [name for name, n in defined.items() if n > 1 and name != "FAMILY"] == []


def test_modules_stay_short():
    long = {str(p.relative_to(REPO)): n for p in TOOLKIT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_both_engines_implement_the_protocol_as_declared():
    import inspect

    from toolkit.adapters.deepspeed import DeepSpeedEngine
    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.engine import Engine
    declared = {n: inspect.signature(f) for n, f in vars(Engine).items() if inspect.isfunction(f) and not n.startswith("_")}
    for engine in (DeepSpeedEngine, MegatronEngine):
        for name, sig in declared.items():
            impl = getattr(engine, name, None)
            assert impl is not None, f"{engine.__name__} lacks {name}"
            assert list(inspect.signature(impl).parameters) == list(sig.parameters), (engine.__name__, name)
