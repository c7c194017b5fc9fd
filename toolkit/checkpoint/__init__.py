from toolkit.checkpoint.manager import CheckpointError, CheckpointManager, find_latest_complete

__all__ = ["CheckpointError", "CheckpointManager", "find_latest_complete"]
