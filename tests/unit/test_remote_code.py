"""No remote code unless asked (issue #40 item 10): a model directory whose config.json names custom
classes (``auto_map``) reached transformers with ``trust_remote_code`` unset, which asks ``[y/N]`` on
stdin; a ``y`` (or a pipe) ran the directory's Python, in ``--dry-run`` too. Now it is refused before
any of it is imported, whatever stdin holds, and ``model.trust_remote_code: true`` runs it on purpose."""
from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import pytest

from tests.helpers.runs import refused, train_args

TOOLKIT = Path(__file__).resolve().parents[2] / "toolkit"

CONFIG_CODE = '''
from pathlib import Path
from transformers import LlamaConfig

Path({marker!r}).write_text("the model directory's code ran")


class MarkerConfig(LlamaConfig):
    model_type = {model_type!r}
'''

MODEL_CODE = '''
from transformers import LlamaForCausalLM
from .configuration_marker import MarkerConfig


class MarkerForCausalLM(LlamaForCausalLM):
    config_class = MarkerConfig
'''


def custom_code_model(root: Path, model_type: str) -> tuple[Path, Path]:
    """(a tiny Llama directory whose config.json names its own classes, the file their import writes)."""
    model, marker = root / model_type, root / "code_ran"  # one module name per model
    model.mkdir()
    config = json.loads((TOOLKIT / "demo" / "tiny-llama" / "config.json").read_text())
    config |= {"model_type": model_type, "architectures": ["MarkerForCausalLM"], "num_hidden_layers": 2,
               "auto_map": {"AutoConfig": "configuration_marker.MarkerConfig",
                            "AutoModelForCausalLM": "modeling_marker.MarkerForCausalLM"}}
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_marker.py").write_text(CONFIG_CODE.format(marker=str(marker), model_type=model_type))
    (model / "modeling_marker.py").write_text(MODEL_CODE)
    return model, marker


@pytest.fixture
def modules_cache(tmp_path_factory, monkeypatch):
    """transformers copies a directory's code into its modules cache before importing it: a private one,
    one per test process (its package, ``transformers_modules``, is imported from the first one used)."""
    import transformers.dynamic_module_utils as dynamic
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path_factory.getbasetemp() / "hf_modules"))


def test_a_model_directory_with_custom_code_is_refused_whatever_stdin_says(tmp_path, monkeypatch, data_cache,
                                                                           modules_cache):
    model, marker = custom_code_model(tmp_path, "toolkit_marker_refused")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))  # what a user (or a pipe) would answer
    args = train_args(tmp_path / "run", data_cache, f"model.name_or_path={model}", nproc=1)
    for command in ([*args, "--dry-run"], args):
        code, out, err = refused(command)
        assert code == 2, (code, out[-2000:], err[-2000:])
        assert (f"model.name_or_path={str(model)!r}: config.json names custom code (auto_map: AutoConfig -> "
                "configuration_marker.MarkerConfig") in err, err
        assert "model.trust_remote_code=true" in err and "Traceback" not in err, err
        assert not marker.exists(), "the directory's code ran"
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_with_custom_code_is_refused(tmp_path, monkeypatch):
    from toolkit.config import ConfigError, load_config
    from toolkit.data import load_tokenizer
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MarkerTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_marker.MarkerTokenizer",
                                                                              None]}}))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    with pytest.raises(ConfigError, match=r"model.tokenizer='.*tokenizer': tokenizer_config.json names custom code "
                                          r"\(auto_map: AutoTokenizer -> tokenization_marker.MarkerTokenizer\).*"
                                          r"model.trust_remote_code=true"):
        load_tokenizer(load_config(None, [f"model.tokenizer={tokenizer}"]))


def test_trust_remote_code_runs_the_directorys_code_when_asked(tmp_path, data_cache, modules_cache):
    model, marker = custom_code_model(tmp_path, "toolkit_marker_trusted")
    args = train_args(tmp_path / "run", data_cache, f"model.name_or_path={model}", "model.trust_remote_code=true",
                      nproc=1)
    code, out, err = refused([*args, "--dry-run"])
    assert code == 0, (out[-2000:], err[-3000:])
    assert marker.exists() and "model: toolkit_marker_trusted" in out, out[-3000:]
    assert "no process group was started" in out


def test_a_trusted_models_plan_rebuilds_its_classes_in_the_ranks(tmp_path, modules_cache):
    """Ranks read plan.json, not the directory's config.json: the plan names the trusted directory, and its
    config (then its model) is rebuilt from the directory's own classes."""
    from toolkit.config import load_config
    from toolkit.families.meta import meta_model
    from toolkit.plan import Plan, build_plan
    model, _ = custom_code_model(tmp_path, "toolkit_marker_planned")
    plan = build_plan(load_config(None, [f"model.name_or_path={model}", "model.trust_remote_code=true"]), [2])
    read = Plan.model_validate_json(plan.model_dump_json())  # as a rank reads RUN_DIR/plan.json
    assert read.model.code_dir == str(model.resolve())
    config = read.model.hf_config()
    assert type(config).__name__ == "MarkerConfig" and config.num_hidden_layers == 2
    assert type(meta_model(config)).__name__ == "MarkerForCausalLM"
    assert build_plan(load_config(), [2]).model.code_dir is None  # transformers' own classes


def test_a_model_transformers_implements_needs_no_trust_even_with_an_auto_map(tmp_path, data_cache, modules_cache):
    """Published checkpoints keep an auto_map after transformers gained the model: transformers' own class
    is used (their code is never imported), as transformers itself does."""
    model, marker = custom_code_model(tmp_path, "llama")
    code, out, err = refused([*train_args(tmp_path / "run", data_cache, f"model.name_or_path={model}", nproc=1),
                              "--dry-run"])
    assert code == 0, err[-3000:]
    assert not marker.exists()


LOADERS = {"from_pretrained", "from_config"}


def test_every_hf_load_in_the_toolkit_says_trust_remote_code():
    """transformers asks on stdin when the keyword is left out: every config, tokenizer, processor and model
    the toolkit loads through an ``Auto*`` or ``PreTrained*`` class names it (peft's loaders run no code)."""
    missing = []
    for path in TOOLKIT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOADERS):
                continue
            owner = ast.unparse(node.func.value)
            if owner.startswith(("Auto", "PreTrained")) and not any(k.arg == "trust_remote_code" for k in node.keywords):
                missing.append(f"{path.relative_to(TOOLKIT.parent)}:{node.lineno} {ast.unparse(node.func)}")
    assert missing == []
