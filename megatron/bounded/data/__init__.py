"""The run's training data, checked before the job takes its GPUs."""
