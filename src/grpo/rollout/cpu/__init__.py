"""Float32 decoding on CPUs, an optional part: grpo's panel kernel (`panel_gemm.c`, built at install as the
extension `grpo.rollout.cpu._panel_gemm` where a C compiler and x86 with AVX2 allow; `panels.py` loads it) and
weights packed for MKL's sgemm (`packed.py`) where it is not. Without either the lean decoder computes with
torch's own matmuls: removing this package changes speed, not numbers."""
