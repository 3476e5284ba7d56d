"""skip_harness: cache RL rollout mini-batches on disk by (step, inner index, rank) and serve them on reruns."""
__version__ = "0.1.0"
