"""Models: loading and preparing the policy (`modeling`, `build`), LoRA (the one module that touches peft),
the float32 head, image prompts (`vision`), the bundled SmolLM2."""
