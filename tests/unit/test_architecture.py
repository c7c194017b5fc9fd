"""The shape of the code (shared/ARCHITECTURE.md): every import, module-level or inside a function,
read from the source with ``ast``. No import circles among toolkit modules, no two rooms (packages
and top-level modules of ``toolkit/``) that import each other, and at most ``MAX_UPWARD`` imports
that run back up a floor of the house (``FLOORS``); only the adapters and the compatibility layers
import DeepSpeed or megatron-core, and one module of them megatron's global parallel state; the loop
knows no model family; every constant, every function body of some length and the loss facts have
one home; functions stay short enough to read at once (``MAX_FUNCTION_LINES``), and each room's size
is reported. Tests import what they share from tests/helpers/, never another test module or conftest.py."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.helpers.runs import REPO

TOOLKIT = REPO / "toolkit"
TESTS = REPO / "tests"
BACKENDS = ("deepspeed", "megatron")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(TOOLKIT.rglob("*.py")):
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
    """LoRA code is ``toolkit/lora/`` (and the backend-specific parts in ``toolkit/adapters/``, the
    on-disk formats of adapters in ``toolkit/formats/``): only those name a module after LoRA, only the
    first two import peft, and only ``toolkit/lora/`` calls peft's ``get_peft_model`` (the one
    skeleton, ``apply_lora``, the converter's reference)."""
    known = modules()
    home = ("toolkit.lora", "toolkit.adapters")
    peft_users = sorted(n for n, p in known.items() if "peft" in {m.split(".")[0] for m in imports(p, n, known)})
    assert [n for n in peft_users if not n.startswith(home)] == []
    assert [n for n in known if "lora" in n.rsplit(".", 1)[-1] and not n.startswith((*home, "toolkit.formats"))] == []
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
``convert`` command; training reads and writes checkpoints through ``toolkit/formats`` (the LoRA
room's ``--verify`` fills ``formats/report.py``'s report)."""
RESUME_CONVERTS = {"toolkit.checkpoint.reshard"}
"""A resume at another layout converts the checkpoint with the command's ``convert`` (LoRA included)."""


def test_only_the_command_line_imports_the_convert_command():
    edges = graph()
    outside = {name: sorted(t for t in targets if t.split(".")[:2] == ["toolkit", "convert"])
               for name, targets in edges.items()
               if not name.startswith("toolkit.convert") and name not in COMMAND_USERS + tuple(RESUME_CONVERTS)}
    assert {n: t for n, t in outside.items() if t} == {}


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


MAX_FUNCTION_LINES = 60
"""A function's code, from its first statement after the docstring to its last line (nested
functions count in their parent too): one screen, read at once. Docstrings do not count: they are
where a function says what it does and gives its tensor layouts."""
LONG_FUNCTIONS: dict[str, str] = {}
"""``module:function`` allowed past ``MAX_FUNCTION_LINES``, each with its reason (none today)."""


def function_lengths(source: str) -> dict[str, int]:
    """``function`` (``Outer.inner`` for methods and nested ones): lines of its code, docstring aside."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{child.name}" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                 ast.ClassDef)) else None
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body[1:] if ast.get_docstring(child) is not None and len(child.body) > 1 else child.body
                out[name] = child.end_lineno - body[0].lineno + 1
            visit(child, f"{name}." if name else prefix)
    visit(ast.parse(source), "")
    return out


def long_functions(sources: dict[str, str]) -> dict[str, int]:
    return {f"{module}:{name}": n for module, text in sources.items()
            for name, n in function_lengths(text).items() if n > MAX_FUNCTION_LINES}


def test_functions_stay_short():
    found = long_functions({name: path.read_text() for name, path in modules().items()})
    assert {f: n for f, n in found.items() if f not in LONG_FUNCTIONS} == {}
    assert sorted(set(LONG_FUNCTIONS) - set(found)) == [], "an exception that is no longer needed"


def test_the_length_rule_finds_a_long_function():
    """Docstring lines are free, code lines are not, and a method is named with its class."""
    doc = '    """' + "\n    words" * 80 + '"""\n'
    code = "    x = 1\n" * MAX_FUNCTION_LINES
    source = f"def short():\n{doc}{code}\nclass A:\n    def long(self):\n        y = 0\n{code.replace('    ', '        ')}"
    assert long_functions({"m": source}) == {"m:A.long": MAX_FUNCTION_LINES + 1}


FLOORS = [
    # 0, the ground: the config and what everything shares
    {"config", "config_input", "remote_code", "layout", "families", "loss", "storage", "device", "heap", "parallel",
     "syncs", "engine", "callable_package", "resources", "compat"},
    {"formats", "lora", "data", "objectives"},  # 1: checkpoint formats, LoRA, the data pipeline, objectives
    {"plan", "estimate"},  # 2: the resolved plan and what reads it before a launch
    {"adapters", "watch", "checkpoint", "observe"},  # 3: inside a rank: engines, the watch, checkpoints, metrics
    {"train"},  # 4: the loop and the rank's entry
    {"run", "launch", "convert"},  # 5: the commands' work and the supervisor
    {"cli", "__main__"},  # 6: the command line
]
"""The house of shared/ARCHITECTURE.md ("Floors, from the ground up"), each of its rooms on its floor,
but for ``observe`` (metrics sinks, the profiler: the loop writes through them, so they stand below
it, beside the watch; the drawing has it above ``train``). The rooms it does not name are placed by
what they are: ``config_input`` and ``remote_code`` beside the config they read, ``heap``,
``parallel``, ``syncs``, ``engine`` (the protocol), ``compat``, ``resources`` and
``callable_package`` on the ground floor; the command line on top. A room is a package of
``toolkit/`` or one of its top-level modules. The front door (``toolkit/__init__.py``) is no room:
Python runs it before any ``toolkit.*`` module, and it imports its API lazily."""
MAX_UPWARD = 3
UPWARD: dict[str, str] = {
    "toolkit.checkpoint.reshard -> toolkit.convert":
        "a resume at another layout converts the checkpoint with the convert command's own function",
}
"""The imports allowed to run back up a floor (at most ``MAX_UPWARD``), each with its reason."""


def room(module: str) -> str:
    """``toolkit.formats.zero`` -> ``formats``; ``toolkit.loss`` -> ``loss``; the front door: ``toolkit``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_imports(edges: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports): the module imports that make it, front door aside."""
    out: dict[tuple[str, str], list[str]] = {}
    for module, targets in edges.items():
        for target in sorted(targets):
            pair = (room(module), room(target))
            if pair[0] != pair[1] and "toolkit" not in pair:
                out.setdefault(pair, []).append(f"{module} -> {target}")
    return out


def room_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in room_imports(edges):
        graph.setdefault(a, set()).add(b)
    return graph


def mutual_rooms(edges: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """Pairs of rooms that import each other, with the imports of both directions."""
    found = room_imports(edges)
    return {(a, b): found[a, b] + found[b, a] for a, b in sorted(found) if a < b and (b, a) in found}


def floor(name: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if name in rooms)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Imports (module -> module) from a room into one on a higher floor."""
    return [edge for (a, b), found in sorted(room_imports(edges).items()) if floor(a) < floor(b) for edge in found]


def test_every_room_stands_on_a_floor():
    rooms = {room(m) for m in modules()} - {"toolkit"}
    assert sorted(r for r in rooms if not any(r in f for f in FLOORS)) == []
    assert sorted(set().union(*FLOORS) - rooms) == []


def test_no_two_rooms_import_each_other():
    assert mutual_rooms(graph()) == {}


def test_few_imports_run_back_up_a_floor():
    found = upward_imports(graph())
    assert len(UPWARD) <= MAX_UPWARD
    assert [edge for edge in found if edge not in UPWARD] == []


def test_the_room_rules_find_a_planted_violation():
    edges = {"toolkit.train.trainer": {"toolkit.watch.events", "toolkit.plan"},
             "toolkit.watch.monitor": {"toolkit.train.worker"}, "toolkit.plan": {"toolkit"}}
    assert mutual_rooms(edges) == {("train", "watch"): ["toolkit.train.trainer -> toolkit.watch.events",
                                                        "toolkit.watch.monitor -> toolkit.train.worker"]}
    assert upward_imports(edges) == ["toolkit.watch.monitor -> toolkit.train.worker"]


def room_sizes() -> dict[str, tuple[int, int, int]]:
    """room: (modules, lines, functions)."""
    sizes: dict[str, list[int]] = {}
    for name, path in modules().items():
        text = path.read_text()
        size = sizes.setdefault(room(name), [0, 0, 0])
        size[0] += 1
        size[1] += len(text.splitlines())
        size[2] += len(function_lengths(text))
    return {r: tuple(v) for r, v in sorted(sizes.items(), key=lambda item: -item[1][1])}


def test_room_size_report():
    """Printed, not asserted (``pytest -s``): where the code's weight lies, by floor."""
    print(f"\n{'room':<18}{'floor':>6}{'modules':>9}{'lines':>8}{'functions':>11}")
    for name, (count, lines, functions) in room_sizes().items():
        where = floor(name) if name != "toolkit" else "-"
        print(f"{name:<18}{where:>6}{count:>9}{lines:>8}{functions:>11}")


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


CLI_MAX_LINES = 180  # argparse (every flag with its help) and dispatch; the launch is in toolkit/run.py
API = ["load_config", "build_plan", "train", "build_engine", "Trainer", "convert", "inspect"]


def test_cli_is_parsing_and_dispatch():
    """No orchestration (it lives in toolkit/run.py) and no heavy import: ``toolkit --help``
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
