from toolkit.observe import doctor


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


def test_cpu_only_torch_on_a_gpu_machine_is_an_error():
    errors: list[str] = []
    gpus = ["GPU 0: NVIDIA H200 (UUID: GPU-1)", "GPU 1: NVIDIA H200 (UUID: GPU-2)"]
    lines = doctor.hardware_lines(errors, gpus, "2.13.0+cpu", None, cuda_available=False)
    assert len(errors) == 1 and "CPU-only build but the machine has 2 NVIDIA GPU(s)" in errors[0]
    assert "driver lists 2 GPU(s)" in lines[0]
    errors.clear()
    doctor.hardware_lines(errors, gpus, "2.13.0+cu128", "12.8", cuda_available=False)
    assert len(errors) == 1 and "cannot use the machine's 2 GPU(s)" in errors[0]
    errors.clear()
    assert "CPU only" in doctor.hardware_lines(errors, [], "2.13.0+cpu", None, cuda_available=False)[0]
    assert not errors  # a CPU machine with a CPU torch is fine


def test_doctor_fails_on_cpu_torch_with_gpus(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "driver_gpus", lambda: ["GPU 0: NVIDIA H200 (UUID: GPU-1)"])
    monkeypatch.setattr("torch.version.cuda", None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert doctor.main() == 1
    assert "CPU-only build" in capsys.readouterr().out


def test_a_cuda_build_without_a_gpu_reports_cuda_nccl_and_no_gpu(monkeypatch):
    """The GPU image on a machine without one (built here): CUDA and NCCL versions, not an error."""
    assert doctor.nccl_version() == "-"  # this CPU torch has no NCCL
    monkeypatch.setattr(doctor, "nccl_version", lambda: "2.29.7")
    errors: list[str] = []
    lines = doctor.hardware_lines(errors, [], "2.13.0", "13.0", cuda_available=False)
    assert lines[0] == "cuda          13.0 (torch's build)   nccl 2.29.7"
    assert lines[1].startswith("devices       CPU only (no GPU visible)") and not errors
