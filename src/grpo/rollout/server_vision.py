"""Image prompts on a vLLM server, by TRL 1.16's route: the server processes the images on their own
(`/v1/chat/completions/render` of a message holding only them, which gives each image's features and the token
block it expands into), and generates from the policy's own token ids with those features
(`/inference/v1/generate`). Both routes are vLLM's scale-out routes (`--enable-scale-out`, which `grpo vllm-serve`
passes).

Where the images sit in the policy's prompt is found from the blocks themselves: image k's block, as the server
expanded it, must appear in the prompt's ids (the model's processor expanded them there) after image k-1's. A block
that does not (vLLM's processing and the model's processor disagree on the image's tokens) is one error naming the
route, rather than a prompt the server reads differently from the training pass (TRL places the features by runs
of image tokens, which also holds where an image is split into tiles only if every tile is one run).
"""

from __future__ import annotations

import uuid
from typing import Any

from grpo.models.vision import encode_image
from grpo.rollout.base import Prompt
from grpo.rollout.server_client import ServerClient, ServerError


def generate(server: ServerClient, model: str, prompt: Prompt, params: dict) -> Any:
    """The choices of one image prompt's generation (`params`: the completion's sampling parameters)."""
    features, blocks = _render(server, model, prompt)
    features = dict(features, mm_placeholders={"image": _placed(server, blocks, list(prompt.ids))})
    body = {
        "request_id": f"grpo-{uuid.uuid4().hex}",
        "model": model,
        "token_ids": list(prompt.ids),
        "features": features,
        "sampling_params": {**params, "output_kind": 2},  # FINAL_ONLY: every one of the n samples
    }
    answer = server.while_alive("POST", "/inference/v1/generate", body)
    return answer.get("choices") if isinstance(answer, dict) else None


def _render(server: ServerClient, model: str, prompt: Prompt) -> tuple[dict, list[list[int]]]:
    """The images' features, and each image's token block as the server expands it."""
    images = prompt.images or ()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encode_image(i)}"}} for i in images]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    try:
        rendered = server.while_alive("POST", "/v1/chat/completions/render", body)
    except ServerError as err:
        if "(404)" in str(err) or "(403)" in str(err) and "scale-out" in str(err).lower():
            raise ServerError(
                f"The vLLM server at {server.url} does not serve /v1/chat/completions/render, which image prompts "
                "take: start it with --enable-scale-out (grpo vllm-serve does)."
            ) from None
        raise
    features = rendered.get("features") if isinstance(rendered, dict) else None
    ids = rendered.get("token_ids") if isinstance(rendered, dict) else None
    ranges = ((features or {}).get("mm_placeholders") or {}).get("image")
    if not isinstance(ids, list) or not isinstance(ranges, list) or len(ranges) != len(images):
        raise ServerError(
            f"The vLLM server at {server.url} rendered {len(images)} images into no usable features "
            f"({len(ranges) if isinstance(ranges, list) else 'no'} image placeholders)."
        )
    blocks = [ids[r["offset"] : r["offset"] + r["length"]] for r in ranges]
    return features, blocks


def _placed(server: ServerClient, blocks: list[list[int]], prompt_ids: list[int]) -> list[dict]:
    """Each block's place in the policy's prompt, in order (see the module docstring)."""
    placed, start = [], 0
    for k, block in enumerate(blocks):
        offset = _find(prompt_ids, block, start)
        if offset < 0:
            raise ServerError(
                f"The vLLM server at {server.url} expands image {k} of a prompt into {len(block)} tokens that the "
                "prompt (as the model's processor expanded it) does not hold: vLLM and the processor disagree on this "
                "model's image tokens. Train it with vllm_mode='colocate' or use_vllm=False."
            )
        placed.append({"offset": offset, "length": len(block)})
        start = offset + len(block)
    return placed


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    for i in range(start, len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1
