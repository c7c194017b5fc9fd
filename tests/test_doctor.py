from toolkit import doctor


def test_pins_parse_and_match_setup_cfg_names():
    pins = doctor.pinned_versions()
    assert pins["torch"] == "2.13.0" and "deepspeed" in pins and "megatron-core" in pins


def test_doctor_reports_and_flags_drift(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "installed", lambda name: {"torch": "2.12.0"}.get(name, "1.0"))
    lines, warnings, errors = doctor.diagnose()
    assert any("torch 2.12.0 is not the tested 2.13.0" in w for w in warnings)
    assert not errors
    monkeypatch.setattr(doctor, "installed", lambda name: None if name == "deepspeed" else "1.0")
    assert doctor.main() == 1 and "deepspeed is not installed" in capsys.readouterr().out
