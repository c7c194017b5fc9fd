"""The shape of the code (shared/ARCHITECTURE.md): every import, module-level or inside a function,
read from the source with ``ast``. No import circles among toolkit modules; only the adapters and
the compatibility layers import DeepSpeed or megatron-core; the loop knows no model family; every
constant has one home; modules stay short enough to read. Tests import what they share from
tests/helpers/, never another test module or conftest.py."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.helpers.runs import REPO

TOOLKIT = REPO / "toolkit"
TESTS = REPO / "tests"
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


COMMAND_USERS = ("toolkit", "toolkit.cli")
"""Outside ``toolkit/convert`` itself, only the command line and the package's front door import the
``convert`` command; training reads and writes checkpoints through ``toolkit/formats``."""
LORA_VERIFY = {"toolkit.lora.checkpoint": ["toolkit.convert.verify"], "toolkit.lora.convert": ["toolkit.convert.verify"]}
"""The LoRA room's ``--verify`` of a LoRA conversion fills the command's report (``convert/verify.py``)."""
RESUME_CONVERTS = {"toolkit.checkpoint.reshard"}
"""A resume at another layout converts the checkpoint with the command's ``convert`` (LoRA included)."""


def test_only_the_command_line_imports_the_convert_command():
    edges = graph()
    outside = {name: sorted(t for t in targets if t.split(".")[:2] == ["toolkit", "convert"])
               for name, targets in edges.items()
               if not name.startswith("toolkit.convert") and name not in COMMAND_USERS + tuple(RESUME_CONVERTS)}
    assert {n: t for n, t in outside.items() if t} == LORA_VERIFY


def test_formats_do_not_import_the_convert_command():
    edges = graph()
    assert {n: sorted(t for t in targets if t.startswith("toolkit.convert"))
            for n, targets in edges.items() if n.startswith("toolkit.formats")} == {
        "toolkit.formats": [], **{n: [] for n in edges if n.startswith("toolkit.formats.")}}


def test_the_loop_knows_no_model_family():
    known = modules()
    for name, path in known.items():
        if name.startswith("toolkit.train"):
            assert not any(m.startswith("toolkit.families") for m in imports(path, name, known)), name


def test_every_constant_has_one_home():
    """Module-level UPPER_CASE names defined in two modules are one value written twice (or two
    meanings under one name); re-exports (imports) do not count, nor ``FAMILY`` and ``TINY``, which
    every family file defines by convention (that is how families and their test configs are found)."""
    defined = Counter()
    for path in modules().values():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            defined.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper() and len(t.id) > 1)
    assert [name for name, n in defined.items() if n > 1 and name not in ("FAMILY", "TINY")] == []


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


def suite_imports(source: str, module: str) -> set[str]:
    """The ``tests.*`` modules a file of the suite (dotted name ``module``) imports, anywhere in it:
    ``from tests.x import y`` counts ``tests.x``, or ``tests.x.y`` where ``tests.x`` is a package (as
    in ``from tests import conftest``); relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tests")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{base}" if base else package
            if base.split(".")[0] == "tests":
                package = REPO.joinpath(*base.split(".")).is_dir()  # then the names are its modules
                found.update(f"{base}.{a.name}" if package else base for a in node.names)
    return found


def forbidden_suite_imports(source: str, module: str) -> list[str]:
    """What the suite's import rule forbids in one file: a test module or conftest.py imported as a
    module. Everything shared lives in tests/helpers/ (helpers import helpers); fixtures live in the
    conftest.py files, which pytest finds itself."""
    return sorted(m for m in suite_imports(source, module) if not m.startswith("tests.helpers."))


def suite_import_offenders(root: Path) -> dict[str, list[str]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        bad = forbidden_suite_imports(path.read_text(), module)
        if bad:
            out[str(path.relative_to(root.parent))] = bad
    return out


def test_no_test_module_imports_another_or_conftest():
    assert suite_import_offenders(TESTS) == {}


def test_the_import_rule_names_test_modules_and_conftest():
    source = ("from tests.helpers.runs import train\nfrom tests.helpers import zoo\nfrom tests.conftest import REPO\n"
              "def f():\n    from tests.distributed.test_moe import WORLD\n    from . import test_lora\n"
              "    import tests.unit.test_data\n")
    assert forbidden_suite_imports(source, "tests.e2e.test_x") == [
        "tests.conftest", "tests.distributed.test_moe", "tests.e2e.test_lora", "tests.unit.test_data"]
