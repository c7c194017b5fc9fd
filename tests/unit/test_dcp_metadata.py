"""The ``.metadata`` unpickler (``toolkit/formats/dcp_metadata.py``) against crafted payloads, each with a
marker that must not appear: a file written (``torch.save``, ``torch.from_file``), a file's content read
into the result (``torch.load``), an attribute set on torch's or DCP's own objects for the rest of the
process (BUILD on a function, a class, an enum member). A real DCP ``.metadata`` (DCP's own writer, in
this process) reads back equal to DCP's bare ``pickle.load``."""
from __future__ import annotations

import pickle

import pytest
import torch

from toolkit.formats.dcp_metadata import load_metadata
from toolkit.formats.errors import ConvertError

MARKER = "proofs4_payload_ran"


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _value(x) -> bytes:
    """A constant's opcodes (a protocol-2 pickle without its header and STOP)."""
    return pickle.dumps(x, protocol=2)[2:-1]


def _call(module: str, name: str, *args) -> bytes:
    """``module.name(*args)``: GLOBAL, the arguments' tuple, REDUCE (what a malicious pickle does)."""
    return _global(module, name) + pickle.MARK + b"".join(a if isinstance(a, bytes) else _value(a) for a in args) \
        + pickle.TUPLE + pickle.REDUCE


def _build(target: bytes, state: dict, slots: bool = False) -> bytes:
    """BUILD on ``target`` with ``state`` as its ``__dict__`` update, or (``slots``) as setattr calls."""
    if slots:
        return target + pickle.NONE + _value(state) + pickle.TUPLE2 + pickle.BUILD
    return target + _value(state) + pickle.BUILD


def _load(tmp_path, body: bytes):
    """What ``load_metadata`` makes of a ``.metadata`` holding ``body``: the result, or the refusal's text."""
    folder = tmp_path / "dcp"
    folder.mkdir(exist_ok=True)
    (folder / ".metadata").write_bytes(pickle.PROTO + b"\x02" + body + pickle.STOP)
    try:
        return load_metadata(folder)
    except ConvertError as exc:
        return str(exc)


def test_torch_save_in_a_metadata_is_refused_and_writes_nothing(tmp_path):
    marker = tmp_path / MARKER
    got = _load(tmp_path, _call("torch", "save", "written", str(marker)))
    assert not marker.exists()
    assert "refusing to unpickle torch.save" in str(got), got


def test_torch_from_file_in_a_metadata_is_refused_and_creates_nothing(tmp_path):
    marker = tmp_path / MARKER
    got = _load(tmp_path, _call("torch", "from_file", str(marker), True, 16))  # shared=True creates the file
    assert not marker.exists()
    assert "refusing to unpickle torch.from_file" in str(got), got


def test_torch_load_in_a_metadata_is_refused_and_reads_nothing(tmp_path):
    """A Metadata whose planner_data is another file's content (torch.load of any path the reader can read)."""
    secret = tmp_path / "secret.pt"
    torch.save(MARKER, secret)
    metadata = _call("torch.distributed.checkpoint.metadata", "Metadata", _value({}),
                     _call("torch", "load", str(secret)))
    got = _load(tmp_path, metadata)
    assert MARKER not in repr(vars(got) if not isinstance(got, str) else got)
    assert "refusing to unpickle torch.load" in str(got), got


def test_build_on_a_function_is_refused(tmp_path):
    """``torch.serialization._get_layout`` is an allowed global (TensorProperties' layout): a BUILD on it
    would set attributes on torch's own function for the rest of the process."""
    from torch.serialization import _get_layout
    try:
        got = _load(tmp_path, _build(_global("torch.serialization", "_get_layout"), {MARKER: True}))
        assert not hasattr(_get_layout, MARKER)
        assert "refusing to unpickle setting attributes on '_get_layout'" in str(got), got
    finally:
        vars(_get_layout).pop(MARKER, None)


def test_build_on_a_class_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata
    try:
        got = _load(tmp_path, _build(_global("torch.distributed.checkpoint.metadata", "Metadata"), {MARKER: 1},
                                     slots=True))
        assert not hasattr(Metadata, MARKER)
        assert "refusing to unpickle setting attributes on 'Metadata'" in str(got), got
    finally:
        if MARKER in vars(Metadata):
            delattr(Metadata, MARKER)


def test_build_on_an_enum_member_is_refused(tmp_path):
    """An enum member is a process-wide singleton (DCP's memory-format encoding), not a fresh instance."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    try:
        got = _load(tmp_path, _build(_call("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", 0),
                                     {MARKER: 1}))
        assert not hasattr(member, MARKER)
        assert "refusing to unpickle setting attributes on 'a torch.distributed.checkpoint.metadata." \
               "_MEM_FORMAT_ENCODING'" in str(got), got
    finally:
        vars(member).pop(MARKER, None)


def test_build_setting_dunder_fields_on_a_dcp_instance_is_refused(tmp_path):
    """A fresh Metadata may get its fields, not a new ``__class__``."""
    metadata = _call("torch.distributed.checkpoint.metadata", "Metadata", _value({}))
    got = _load(tmp_path, _build(metadata, {"__class__": 1}, slots=True))
    assert "refusing to unpickle setting (None, {'__class__': 1}) on a Metadata" in str(got), got


def test_a_real_metadata_reads_as_dcps_own_unpickling_reads_it(tmp_path):
    """Every tensor dtype and a pickled item (the optimizer's param_groups): as ``pickle.load`` gives it."""
    import torch.distributed.checkpoint as dcp
    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16),
                       "n": torch.ones(2, dtype=torch.int64)},
             "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with open(tmp_path / "dcp" / ".metadata", "rb") as f:
        trusted = pickle.load(f)  # written by this test just now
    assert vars(load_metadata(tmp_path / "dcp")) == vars(trusted)


def test_the_dcp_writer_refuses_a_config_whose_model_the_source_does_not_hold(tmp_path):
    """``convert --to dcp`` with an HF config of another model (3 layers for a 2-layer checkpoint): the names
    the source lacks are listed before anything is written."""
    from types import SimpleNamespace

    from toolkit.families.meta import meta_model
    from toolkit.families.tiny import tiny_config
    from toolkit.formats.dcp_write import _state_dict_names
    held = {n: (tuple(t.shape), None) for n, t in meta_model(tiny_config("llama", num_hidden_layers=2)).state_dict().items()}
    source = SimpleNamespace(hf_config=tiny_config("llama", num_hidden_layers=3).to_dict(), tied=False,
                             path=tmp_path / "ckpt", model_type="llama")
    with pytest.raises(ConvertError, match=r"the HF llama model's state dict has \['model.layers.2.*which the source "
                                           r"does not hold \(wrong --hf-config\?\)"):
        _state_dict_names(source, held)
    assert len(_state_dict_names(SimpleNamespace(**{**vars(source), "hf_config": tiny_config("llama",
                                 num_hidden_layers=2).to_dict()}), held)) == len(held)

