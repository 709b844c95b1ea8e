"""Prometheus metrics of a training run, labelled by job and run, served on `metrics_port` by rank 0."""

from prometheus_client import Counter, Gauge

_LABELS = ["job_id", "run_name"]
STEP = Gauge("eagle3_trainer_step", "Optimizer steps done", _LABELS)
TOKENS = Counter("eagle3_trainer_tokens", "Real (unpadded) tokens trained on by this process's run", _LABELS)
LOSS = Gauge("eagle3_trainer_loss", "TTT loss of the last step (step-decay weighted sum)", _LABELS)
POSITION_LOSS = Gauge(
    "eagle3_trainer_position_loss", "Loss of draft position i at the last step", [*_LABELS, "position"]
)
POSITION_ACCURACY = Gauge(
    "eagle3_trainer_position_accuracy", "Top-1 accuracy of draft position i at the last step", [*_LABELS, "position"]
)
LEARNING_RATE = Gauge("eagle3_trainer_learning_rate", "Learning rate of the last step", _LABELS)
TOKENS_PER_SECOND = Gauge("eagle3_trainer_tokens_per_second", "Training tokens/s over the last log window", _LABELS)
PEAK_DEVICE_MEMORY = Gauge(
    "eagle3_trainer_peak_device_memory_bytes",
    "Peak GPU memory allocated by this process over the last log window (GPU runs only)",
    _LABELS,
)
HELDOUT_ACCEPTANCE = Gauge(
    "eagle3_trainer_heldout_simulated_acceptance_length", "Simulated acceptance length on held-out shards", _LABELS
)
