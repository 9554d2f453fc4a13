"""Image prompts on a vLLM server: `/inference/v1/generate` (vLLM's token-in route, the one TRL 1.16's image prompts
take; `--enable-scale-out`, which `grpo vllm-serve` passes) with the prompt's ids as the template wrote them (one
placeholder per image, `Prompt.unexpanded_ids`) and the images, which the server expands itself, as vLLM in colocate
mode does (`grpo.rollout.vllm.multimodal_input`). The server's expansion must be the model's processor's (which the
training pass scores): the prompt ids the server answers with are checked against it (`check_expanded`).

TRL 1.16 instead renders the images into features first and places them by runs of image tokens in its own ids;
for a model that splits an image into tiles with other tokens between them (Idefics3, SmolVLM: 460 placeholder
tokens of which 112 are image embeddings in the test's model) vLLM refuses such features ("Attempted to assign 112
multimodal tokens to 460 placeholders"), and its engine stops: the route here does not need the placements.
"""

from __future__ import annotations

import uuid
from typing import Any

from grpo.base.records import Prompt
from grpo.models.vision import encode_image
from grpo.rollout.server_client import ServerClient, ServerError
from grpo.rollout.vllm import check_expanded


def generate(server: ServerClient, model: str, prompt: Prompt, tokenizer: Any, params: dict) -> Any:
    """The choices of one image prompt's generation (`params`: the completion's sampling parameters)."""
    images = prompt.images or ()
    body = {
        "request_id": f"grpo-{uuid.uuid4().hex}",
        "model": model,
        "token_ids": prompt.unexpanded_ids(tokenizer),
        "content_parts": [{"type": "image_url", "url": f"data:image/png;base64,{encode_image(i)}"} for i in images],
        "sampling_params": {**params, "output_kind": 2},  # FINAL_ONLY: every one of the n samples
    }
    try:
        answer = server.while_alive("POST", "/inference/v1/generate", body, progress=True)
    except ServerError as err:
        if "(404)" in str(err) or ("(403)" in str(err) and "scale-out" in str(err).lower()):
            raise ServerError(
                f"The vLLM server at {server.url} does not serve /inference/v1/generate, which image prompts take: "
                "start it with --enable-scale-out (grpo vllm-serve does)."
            ) from None
        raise
    if not isinstance(answer, dict):
        return None
    try:
        check_expanded(prompt, answer.get("prompt_token_ids"))
    except RuntimeError as err:
        raise ServerError(f"The vLLM server at {server.url}: {err}") from None
    return answer.get("choices")
