"""Training runs of the experiments: the trainers, the Pipe-SGD family's configuration, runs and analysis, decentralized training's timing, their timing models, and learning-rate selection."""
