"""Workloads: the data sets, models, tasks, batch streams, sharding and learning-rate schedules the training experiments run."""
