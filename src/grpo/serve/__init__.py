"""vLLM's side of server mode: what runs inside vLLM's processes or starts them. `launcher` (`grpo vllm-serve`:
vLLM's own server with the flags the trainer needs), `guard` (the middleware that keys and guards its routes),
`vllm_plugin` and `gloo` (grpo's `gloo` weight-transfer engine, which vLLM loads through its plugin entry point) and
`vllm_reload` (what a weight load leaves stale on vLLM's CPU backend). Plain torch and the standard library; vLLM
is imported only inside functions that run where it is."""
