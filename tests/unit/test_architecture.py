"""The shape of the code (shared/ARCHITECTURE.md): every import, module-level or inside a function,
read from the source with ``ast``. No import circles among toolkit modules; only the adapters and
the compatibility layers import DeepSpeed or megatron-core, and one module of them megatron's global
parallel state; the loop knows no model family; every constant, every function body of some length
and the loss facts have one home; modules stay short enough to read. Tests import what they share
from tests/helpers/, never another test module or conftest.py."""
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


def module_constants() -> list[tuple[str, str, ast.expr]]:
    """(module, name, value) of every module-level UPPER_CASE assignment in the package."""
    out = []
    for module, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            out += [(module, t.id, node.value) for t in targets
                    if isinstance(t, ast.Name) and t.id.isupper() and len(t.id) > 1]
    return out


def test_every_constant_has_one_home():
    """Module-level UPPER_CASE names defined in two modules are one value written twice (or two
    meanings under one name); re-exports (imports) do not count, nor ``FAMILY`` and ``TINY``, which
    every family file defines by convention (that is how families and their test configs are found)."""
    defined = Counter(name for _, name, _ in module_constants())
    assert [name for name, n in defined.items() if n > 1 and name not in ("FAMILY", "TINY")] == []


def test_no_value_is_a_constant_twice_under_two_names():
    """A string or a collection literal (a file name, a key list) bound to two constants is one fact
    with two homes (``toolkit_megatron.json`` was ``DESCRIPTION`` in the engine's checkpoint code and
    ``TOOLKIT_JSON`` in the converter). Numbers are left out: two 8s rarely mean one thing."""
    homes: dict[str, list[str]] = {}
    for module, name, value in module_constants():
        try:
            literal = ast.literal_eval(value)
        except ValueError:
            continue
        if not isinstance(literal, (int, float, bool, type(None))):
            homes.setdefault(repr(literal), []).append(f"{module}.{name}")
    assert {value: names for value, names in homes.items() if len(names) > 1} == {}


MIN_DUPLICATE_STATEMENTS = 4
"""Bodies of fewer statements (``return math.prod(self.shape)``, a property) may coincide by
nature; four and more written twice are one piece of logic with two homes."""


def statements(body: list[ast.stmt]) -> int:
    """Statements in ``body``, nested blocks (if/for/with/try) counted too."""
    return sum(1 + statements([s for f in ("body", "orelse", "finalbody", "handlers")
                               for s in getattr(node, f, []) if isinstance(s, ast.AST)]) for node in body)


def duplicate_bodies(sources: dict[str, str]) -> list[list[str]]:
    """Groups of functions (``module:line name``) whose bodies, docstring aside, dump to the same
    ``ast`` (the same code, whatever the function's name and signature)."""
    by_body: dict[str, list[str]] = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if statements(body) >= MIN_DUPLICATE_STATEMENTS:
                key = "\n".join(ast.dump(s) for s in body)
                by_body.setdefault(key, []).append(f"{module}:{node.lineno} {node.name}")
    return [names for names in by_body.values() if len(names) > 1]


def test_no_two_functions_share_a_body():
    assert duplicate_bodies({name: path.read_text() for name, path in modules().items()}) == []


def test_the_duplicate_finder_finds_one():
    """Same body under other names and docstrings is found; a one-statement body or one constant
    apart is not."""
    body = "    rows = budget // (4 * vocab)\n    rows -= rows % 8\n    if rows < 8:\n        rows = 8\n    return rows\n"
    found = duplicate_bodies({
        "a": f"def chunk_rows(vocab, budget):\n    \"\"\"Rows per chunk.\"\"\"\n{body}",
        "b": f"def rows_for(vocab, budget):\n{body}\n\ndef other(vocab, budget):\n{body.replace('8', '16')}",
        "c": "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n"})
    assert found == [["a:1 chunk_rows", "b:1 rows_for"]]


def test_only_the_grid_reads_megatrons_parallel_state():
    """megatron-core's global parallel state (ranks, sizes, process groups) is read in one module,
    ``adapters/megatron/grid.py``; sizes elsewhere come from the run's ``Layout``."""
    readers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            if any(n.startswith("megatron.core.parallel_state") for n in names):
                readers.append(name)
    assert sorted(set(readers)) == ["toolkit.adapters.megatron.grid"]


def test_the_loss_facts_have_one_home():
    """The ignore index, the token loss sum and its chunk sizing live in ``toolkit/loss.py``: the
    data pipeline and the estimate import it, not the engine protocol; no other module writes -100."""
    known = modules()
    for name, path in known.items():
        if name.startswith(("toolkit.data", "toolkit.plan", "toolkit.estimate")):
            assert "toolkit.engine" not in imports(path, name, known), f"{name} imports toolkit.engine"
    writers = [name for name, path in known.items() for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
               and isinstance(node.operand, ast.Constant) and node.operand.value == 100]
    assert writers == ["toolkit.loss"]


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


def test_compat_layers_do_not_depend_on_the_data_pipeline():
    """compat/ patches libraries and keeps their caches; the cache root it needs lives in storage/."""
    known = modules()
    found = {name: sorted(m for m in imports(path, name, known) if m.startswith("toolkit.data"))
             for name, path in known.items() if name.startswith("toolkit.compat")}
    assert {n: m for n, m in found.items() if m} == {}


CLI_MAX_LINES = 180  # argparse (every flag with its help) and dispatch; the launch is in toolkit/launch/run.py
API = ["load_config", "build_plan", "train", "build_engine", "Trainer", "convert", "inspect"]


def test_cli_is_parsing_and_dispatch():
    """No orchestration (it lives in toolkit/launch/run.py) and no heavy import: ``toolkit --help``
    and every command's flag errors stay fast."""
    cli = TOOLKIT / "cli.py"
    assert len(cli.read_text().splitlines()) <= CLI_MAX_LINES
    heavy = {m for m in imports(cli, "toolkit.cli", modules()) if m.split(".")[0] in (*BACKENDS, "torch", "transformers")}
    assert heavy == set()


def test_the_front_door_exports_exactly_the_documented_api():
    """``toolkit.__all__`` is the API the docstring documents, each name resolves to a callable, and
    no other public name is defined there (submodules aside)."""
    import types

    import toolkit
    assert toolkit.__all__ == API
    assert all(f"{name}(" in toolkit.__doc__ for name in API)
    assert all(callable(getattr(toolkit, name)) for name in API)
    public = {n for n, v in vars(toolkit).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public <= set(API)
