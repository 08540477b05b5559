"""DeepSpeed setup, the classifier's optimizer, schedule, train loop, checkpoints, preemption."""
