"""The config zoo's coverage (``tests/helpers/zoo.py``): every variant meets every feature, every axis value
published checkpoints vary on is in the zoo (read from the built HF configs, not from the labels),
and every feature meets every axis value (by running it, or by asserting the refusal where the
toolkit refuses the combination)."""
from __future__ import annotations

import pytest

from tests.helpers.zoo import AXES, FEATURES, MATRIX, REFUSALS, VARIANTS, axes, cells, convert_path, lora_convert_path


def test_every_variant_meets_every_feature():
    assert sorted(MATRIX) == sorted(VARIANTS)
    for variant, row in MATRIX.items():
        assert sorted(row) == sorted(FEATURES), variant
        assert all(row.values()), variant
    refused = {(v, f) for v, row in MATRIX.items() for f, s in row.items() if s == "refused"}
    assert refused == set(REFUSALS)  # a refused cell says what its refusal must name


def test_every_family_has_a_variant():
    from toolkit.families import supported
    assert {v.family for v in VARIANTS.values()} == set(supported())


def test_the_zoo_holds_every_axis_value():
    found = set().union(*(axes(v) for v in VARIANTS))
    assert AXES <= found, sorted(AXES - found)


@pytest.mark.parametrize("feature", FEATURES)
def test_every_feature_meets_every_axis_value(feature):
    met = set().union(*(axes(v) for v in cells(feature)))
    assert AXES <= met, sorted(AXES - met)


def test_convert_paths_meet_every_direction_and_layout():
    hops = {(a[0], b[0]) for s in cells("convert").values() for a, b in zip(convert_path(s), convert_path(s)[1:])}
    assert hops == {(a, b) for a in ("hf", "zero", "megatron") for b in ("hf", "zero", "megatron") if a != b}
    layouts = {(lay["tp"], lay["pp"]) for s in cells("convert").values()
               for f, lay in convert_path(s) if f == "megatron"}
    stages = {lay["zero_stage"] for s in cells("convert").values() for f, lay in convert_path(s) if f == "zero"}
    assert {(2, 1), (1, 2)} <= layouts and stages == {1, 2, 3}


def test_lora_checkpoint_paths_meet_every_direction():
    hops = {(a[0], b[0]) for s in cells("lora_convert").values()
            for a, b in zip(lora_convert_path(s), lora_convert_path(s)[1:])}
    assert hops == {("zero", "megatron"), ("megatron", "zero"), ("zero", "peft"), ("megatron", "peft"),
                    ("peft", "megatron")}
    assert all(lora_convert_path(s)[0][0] == "zero" for s in cells("lora_convert").values())  # the run's own


def test_settings_rotate_over_stages_layouts_and_engines():
    assert set(cells("lora_deepspeed").values()) == {"zero2", "zero3"}
    assert set(cells("lora_megatron").values()) == {"tp2", "pp2", "tp2_sp", "refused"}
    resumes = {tuple(s.split(">")) for s in cells("resume").values()}
    assert all(a != b for a, b in resumes) and {a for a, _ in resumes} == {b for _, b in resumes} == {"z1", "z2", "z3"}
    assert set(cells("export").values()) == {"zero", "lora-zero", "lora-megatron"}
    for variant, how in cells("export").items():  # an export comes from an engine the variant runs
        assert how != "lora-megatron" or MATRIX[variant]["lora_megatron"] != "refused", variant
