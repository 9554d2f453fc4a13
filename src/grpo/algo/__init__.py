"""The math: pure functions of tensors (losses, advantages, token log-probs and the tiled output head, the
loss's extra terms, entropy control, the sampling-mismatch correction). No model, accelerator or I/O."""
