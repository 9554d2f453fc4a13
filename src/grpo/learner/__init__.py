"""The learner: the training batch, the training pass, the micro-step loop, the optimizer, the reference
model's sync, and the run's accelerator."""
