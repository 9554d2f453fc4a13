"""Speed and memory patches: each computes what the plain path computes (tested against it), is chosen per run
with the reason logged when it does not apply, and nothing in the math modules imports them.

- `kernels`: a linear layer with its weight cast once, and transformers' RMSNorm written out (shared by the lean
  decoder and the blocks);
- `blocks`: Llama-family norms and MLPs that keep less for backward in the training pass (on where they apply);
- `linears`: bf16 linears that keep float32 weights for backward (opt-in: `GRPOConfig.lean_linears`);
- `attention`: grouped key/value heads read as they are by CPU attention;
- `allocator`: glibc keeps freed memory for reuse on CPU (`GRPOConfig.cpu_keep_freed_memory`).
- `compilation`: torch.compile of the training forward (`GRPOConfig.torch_compile`) and TF32 (`tf32`).
"""
