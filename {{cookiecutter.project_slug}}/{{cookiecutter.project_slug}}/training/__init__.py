"""The step and what runs around it: steps, optimizer, metrics, checkpoints (runs),
writers, FLOPs."""
