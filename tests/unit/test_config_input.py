"""A run config means what it says or is refused (issue #40): every number checked against its meaning,
booleans and integers strict, YAML mistakes and bad bytes reported at their line and column, keys of the
backend not in use refused, and the layout's refusals naming a fix that exists. Each case here passed
(or failed with a traceback) before."""
from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.config import ConfigError, load_config, validate
from toolkit.plan import build_plan

REPO = Path(__file__).resolve().parents[2]

# key=value -> what the refusal must say (the key, the value and the bound)
OUT_OF_RANGE = {
    "train.lr=-1": r"train.lr=-1 must be >= 0 \(the peak learning rate; 0 holds the weights fixed",
    "train.lr=-1e-4": r"train.lr=-0.0001 must be >= 0",
    "train.log_every=0": r"train.log_every=0 must be >= 1",
    "train.warmup_steps=-5": r"train.warmup_steps=-5 must be >= 0",
    "train.min_lr=-1e-5": r"train.min_lr=-1e-05 must be >= 0",
    "train.min_lr=0.01": r"train.min_lr=0.01 is above train.lr=0.003: the schedule decays from lr to min_lr",
    "train.weight_decay=-0.1": r"train.weight_decay=-0.1 must be >= 0",
    "train.grad_clip=-1": r"train.grad_clip=-1 must be >= 0",
    "train.adam_beta1=1": r"train.adam_beta1=1 must be < 1",
    "train.adam_beta2=-0.5": r"train.adam_beta2=-0.5 must be >= 0",
    "train.adam_eps=0": r"train.adam_eps=0 must be > 0",
    "train.eval_every=-1": r"train.eval_every=-1 must be >= 0",
    "train.eval_batches=0": r"train.eval_batches=0 must be >= 1",
    "train.seed=-3": r"train.seed=-3 must be >= 0",
    "train.moe_aux_loss_coeff=-1": r"train.moe_aux_loss_coeff=-1 must be >= 0",
    "nproc=0": r"nproc=0 must be >= 1",
    "nproc=-1": r"nproc=-1 must be >= 1",
    "data.num_proc=0": r"data.num_proc=0 must be >= 1",
    "checkpoint.keep_last=-1": r"checkpoint.keep_last=-1 must be >= 0",
    "restart.max_restarts=-2": r"restart.max_restarts=-2 must be >= 0",
    "restart.backoff_s=-1": r"restart.backoff_s=-1 must be >= 0",
    "restart.straggler_every=-1": r"restart.straggler_every=-1 must be >= 0",
    "restart.straggler_factor=0.5": r"restart.straggler_factor=0.5 must be >= 1",
    "restart.straggler_min_gap_s=-1": r"restart.straggler_min_gap_s=-1 must be >= 0",
    "restart.divergence_every=-1": r"restart.divergence_every=-1 must be >= 0",
    "megatron.first_stage_layers=0": r"megatron.first_stage_layers=0 must be >= 1",
    "train.lr=.nan": r"train.lr=nan: must be a finite number",
}


@pytest.mark.parametrize("setting", list(OUT_OF_RANGE))
def test_numbers_outside_their_meaning_are_refused_naming_the_key_and_the_bound(setting):
    with pytest.raises(ConfigError, match=OUT_OF_RANGE[setting]):
        load_config(None, [setting])


def test_bounds_that_mean_off_or_equal_are_accepted():
    cfg = load_config(None, ["train.grad_clip=0", "train.eval_every=0", "train.warmup_steps=0", "train.min_lr=0",
                             "train.weight_decay=0", "train.adam_beta1=0", "checkpoint.keep_last=0",
                             "train.min_lr=3e-3", "restart.max_restarts=0"])
    assert cfg.train.grad_clip == 0 and cfg.train.min_lr == cfg.train.lr == 3e-3
    frozen = load_config(None, ["train.lr=0", "train.min_lr=0"])  # weights held fixed: losses measured on them
    assert frozen.train.lr == frozen.train.min_lr == 0


def test_min_lr_follows_lr_unless_set():
    """A lower ``train.lr`` alone is a fine-tuning run's usual setting: its floor follows it (lr / 10, the
    default lr's 3e-4 as before), so it is never refused for a floor the user did not set."""
    assert load_config(None, ["train.lr=1e-5"]).train.min_lr == pytest.approx(1e-6)
    assert load_config(None, []).train.min_lr == pytest.approx(3e-4)
    assert load_config(None, ["train.lr=1e-5", "train.min_lr=0"]).train.min_lr == 0


STRICT = {
    "train.steps=true": r"train.steps=True: expected an integer, got a boolean",
    "train.steps=2.5": r"train.steps=2.5: expected a whole number",
    "train.steps=3.0": r"train.steps=3.0: expected a whole number",
    "zero.stage=true": r"zero.stage=True: expected one of 0, 1, 2, 3, got a boolean",
    "train.export_hf=1": r"train.export_hf=1: expected true or false",
    "train.lr=false": r"train.lr=False: expected a number, got a boolean",
    "model.tf32=yes please": r"model.tf32='yes please': expected true or false",
    "train.lr='0.1'": r"train.lr='0.1': expected a number, got text",
    "data.split=2023": r"data.split=2023: expected text; quote it",
}


@pytest.mark.parametrize("setting", list(STRICT))
def test_booleans_integers_and_text_are_strict(setting):
    """``train.steps=true`` trained 1 step and ``2.0`` counted as 2: no coercion between kinds."""
    with pytest.raises(ConfigError, match=STRICT[setting]):
        load_config(None, [setting])


def test_paths_given_through_the_python_api_are_text(tmp_path):
    assert validate({"data": {"path": tmp_path / "d.jsonl"}}).data.path == str(tmp_path / "d.jsonl")


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    """YAML 1.1 reads ``1e-4`` (no dot) as text; with strict numbers the loader must read it as YAML 1.2 does."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1e-4\n  min_lr: 5E-6\n  adam_eps: 1.0e-8\n")
    cfg = load_config(path, ["train.weight_decay=1e-2"])
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.adam_eps, cfg.train.weight_decay) == (1e-4, 5e-6, 1e-8, 1e-2)


def test_duplicate_yaml_keys_are_refused_at_the_second(tmp_path):
    """Last-one-wins hid the first value: ``steps: 3`` then ``steps: 5`` trained 5 steps without a word."""
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 3\n  lr: 1.0e-3\n  steps: 5\n")
    with pytest.raises(ConfigError, match=rf"{path}:4:3: duplicate key 'steps' \(first at line 2\)"):
        load_config(path)
    path.write_text("train:\n  steps: 3\ntrain:\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=rf"{path}:3:1: duplicate key 'train' \(first at line 1\)"):
        load_config(path)


def test_yaml_syntax_errors_name_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: [3\n")
    with pytest.raises(ConfigError, match=rf"{path}:3:1: not valid YAML: expected ',' or ']'"):
        load_config(path)
    path.write_text("train:\n  steps: 3\n   lr: 1\n")
    with pytest.raises(ConfigError, match=rf"{path}:3:6: not valid YAML: mapping values are not allowed here"):
        load_config(path)


def test_overrides_that_are_not_yaml_are_refused():
    with pytest.raises(ConfigError, match=r"--set 'train.steps=\[3': the value is not valid YAML"):
        load_config(None, ["train.steps=[3"])
    with pytest.raises(ConfigError, match=r"--set 'lora.target_modules=\{a: 1, a: 2\}': duplicate key 'a'"):
        load_config(None, ["lora.target_modules={a: 1, a: 2}"])


def test_config_bytes_that_are_not_utf8_are_located(tmp_path):
    path = tmp_path / "enc.yaml"
    path.write_bytes(b"train:\n  steps: 3 # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{path}:2:17: byte 0xe9 is not UTF-8; save the file as UTF-8"):
        load_config(path)


def test_a_directory_given_as_the_config_is_named_as_one(tmp_path):
    (tmp_path / "run.yaml").write_text("train:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=rf"config {tmp_path} is a directory, not a YAML file; "
                                          rf"give a file in it \(run.yaml\)"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="config file .*missing.yaml does not exist"):
        load_config(tmp_path / "missing.yaml")


OTHER_BACKEND = {
    ("deepspeed", "megatron.tp=2"): r"megatron.tp=2 is megatron's \(backend=megatron\), ignored by "
                                    r"backend=deepspeed; unset megatron.tp \(or set backend=megatron\)",
    ("deepspeed", "megatron.preset=tp2"): r"megatron.preset='tp2' is megatron's",
    ("megatron", "zero.stage=3"): r"zero.stage=3 is DeepSpeed's \(backend=deepspeed\), ignored by backend=megatron",
    ("megatron", "zero.offload_optimizer=true"): r"zero.offload_optimizer=True is DeepSpeed's",
    ("megatron", "zero.ds_config=zero3"): r"zero.ds_config='zero3' is DeepSpeed's",
}


@pytest.mark.parametrize("backend,setting", list(OTHER_BACKEND))
def test_keys_of_the_backend_not_in_use_are_refused_when_set(backend, setting):
    """megatron.tp=2 on DeepSpeed ran dp=2; zero.stage=3 and offload on megatron were dropped."""
    with pytest.raises(ConfigError, match=OTHER_BACKEND[(backend, setting)]):
        load_config(None, [f"backend={backend}", setting])


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_a_runs_own_config_yaml_loads(tmp_path, backend):
    """RUN_DIR/config.yaml holds both sections (every key written): the unused one, at its defaults, loads."""
    from toolkit.config import dump_config
    from toolkit.plan import build_plan
    cfg = load_config(None, [f"backend={backend}", "zero.stage=2", "megatron.tp=1", "train.lr=1e-4",
                             "train.min_lr=1e-5", "train.adam_eps=1e-8"])
    planned = build_plan(cfg, [2]).config  # what a launch writes: presets and DeepSpeed JSON values applied
    dump_config(planned, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == planned


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*/config.yaml")), ids=lambda p: p.parent.name)
def test_shipped_examples_load(path):
    assert load_config(path).run_dir


@pytest.mark.parametrize("preset", ["pp2", "pp2_vpp2", "tp2", "tp2_pp2", "tp2_sp", "tp8_recompute"])
def test_shipped_megatron_presets_load(preset):
    from toolkit.plan.presets import with_megatron_preset
    cfg = with_megatron_preset(load_config(None, ["backend=megatron", f"megatron.preset={preset}"]))
    assert cfg.megatron.tp >= 1


def test_a_preset_file_is_read_by_the_same_rules(tmp_path):
    from toolkit.plan.presets import with_megatron_preset
    preset = tmp_path / "layout.yaml"
    preset.write_text("tp: 2\npp: 1\ntp: 4\n")
    cfg = load_config(None, ["backend=megatron", f"megatron.preset={preset}"])
    with pytest.raises(ConfigError, match=rf"{preset}:3:1: duplicate key 'tp' \(first at line 1\)"):
        with_megatron_preset(cfg)
    preset.write_bytes(b"tp: 2 # \xff\n")
    with pytest.raises(ConfigError, match=rf"{preset}:1:9: byte 0xff is not UTF-8"):
        with_megatron_preset(cfg)


def test_a_global_batch_no_micro_batch_fits_names_the_fixes_that_exist():
    """``--nproc 3`` said ``choose micro_batch_size in []``."""
    cfg = load_config(None, ["nproc=3"])
    with pytest.raises(ConfigError) as caught:
        build_plan(cfg, [3])
    message = str(caught.value)
    assert "[]" not in message
    assert ("train.global_batch_size=16 cannot be split over dp=3 data-parallel ranks (16 is not a multiple of 3); "
            "choose train.global_batch_size a multiple of 3 x train.micro_batch_size=4 (12, 24, 36), "
            "or a data-parallel size in [1, 2, 4, 8, 16]") in message, message


@pytest.mark.parametrize("sets, says, never", [
    ([], "model in runs/demo/hf_final", "adapter"),
    (["lora.rank=4"], "model in runs/demo/hf_final, LoRA adapter in runs/demo/adapter", "no hf_final"),
    (["train.export_hf=false"], "no hf_final (train.export_hf=false); the last checkpoint holds the model: "
                                "toolkit convert runs/demo DIR", "model in"),
    (["train.export_hf=false", "checkpoint.every=0"], "no model written (train.export_hf=false, checkpoint.every=0)",
     "model in"),
])
def test_the_last_line_of_a_run_says_what_it_wrote(sets, says, never):
    """"model in RUN/hf_final" was printed with train.export_hf=false, which writes none."""
    from toolkit.run import done_line
    line = done_line(load_config(None, sets))
    assert says in line and never not in line, line
