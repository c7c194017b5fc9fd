from toolkit.checkpoint.manager import CheckpointError, CheckpointManager, find_latest_complete, verify_checkpoint

__all__ = ["CheckpointError", "CheckpointManager", "find_latest_complete", "verify_checkpoint"]
