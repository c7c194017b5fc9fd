import json

from toolkit.checkpoint import CheckpointManager, find_latest_complete
from toolkit.storage import verify_complete


def _save(mgr, step, payload=b"x" * 100):
    stage = mgr.begin(step)
    (stage / "engine").mkdir()
    (stage / "engine" / "weights.bin").write_bytes(payload)
    return mgr.commit(step)


def test_commit_is_complete_and_latest_points_to_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    final = _save(mgr, 5)
    assert final.name == "step_00000005" and not mgr.staging(5).exists()
    assert verify_complete(final) == []
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000005"
    manifest = json.loads((final / "manifest.json").read_text())["files"]
    assert manifest["engine/weights.bin"]["bytes"] == 100


def test_retention_keeps_last_n(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _save(mgr, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]


def test_broken_checkpoints_are_skipped_not_deleted(tmp_path):
    """Newest first, each broken checkpoint is skipped and named with its own problem; the
    half-written save (a staging directory) is not a checkpoint at all; nothing is deleted."""
    logs = []
    mgr = CheckpointManager(tmp_path, keep_last=6)
    good = _save(mgr, 1)
    flipped = _save(mgr, 2)
    truncated = _save(mgr, 3)
    half_written = mgr.begin(4)  # a crash before commit: only the staging dir exists
    (half_written / "x").write_text("partial")
    unmarked = _save(mgr, 5)
    (unmarked / "COMPLETE").unlink()  # a copy without its marker (e.g. rsync'd while being written)
    data = bytearray((flipped / "engine" / "weights.bin").read_bytes())
    data[10] ^= 1
    (flipped / "engine" / "weights.bin").write_bytes(bytes(data))
    (truncated / "engine" / "weights.bin").write_bytes(b"x" * 50)
    assert find_latest_complete(tmp_path, log=logs.append) == good
    assert logs == [
        f"skipping checkpoint step_00000005: {unmarked}: no COMPLETE marker (the save did not finish)",
        "skipping checkpoint step_00000003: engine/weights.bin: 50 bytes, manifest says 100 (truncated?)",
        "skipping checkpoint step_00000002: engine/weights.bin: sha256 differs from the manifest (corrupted)"]
    assert all(p.exists() for p in (flipped, truncated, unmarked, half_written))


def test_missing_complete_marker(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    final = _save(mgr, 1)
    (final / "COMPLETE").unlink()
    assert "no COMPLETE marker" in verify_complete(final)[0]
    assert find_latest_complete(tmp_path, log=lambda m: None) is None


def test_background_persist_writes_the_manifest_a_synchronous_save_would(tmp_path):
    from toolkit.checkpoint.async_save import persist_tree
    from toolkit.storage import build_manifest
    src = tmp_path / "snapshot"
    (src / "engine" / "global_step4").mkdir(parents=True)
    (src / "engine" / "global_step4" / "model.pt").write_bytes(bytes(range(256)) * 40000)
    (src / "trainer.json").write_text("{}")
    seen = []
    entries = persist_tree(src, tmp_path / "staged", on_file=seen.append)
    assert entries == build_manifest(tmp_path / "staged")["files"] == build_manifest(src)["files"]
    assert sorted(seen) == sorted(entries)
