"""Small utilities shared by the workers and the trainer (FLOPs / MFU accounting)."""
