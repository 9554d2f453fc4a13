"""The fast engine's tests' setting (tests/equivalence/test_fast_generation.py, and the sharded job
support/jobs/fsdp_job.py): a tiny model of each family the lean decoder takes, the sampling settings, stop tokens and
requests (two chat prompts, four samples each), and greedy sampling."""

from __future__ import annotations

from grpo.algo.sampling import SamplingSettings
from grpo.data.prompts import end_of_turn_ids, tokenize_prompts
from support.scripted import as_requests
from support.tiny import make_gemma3, make_model, make_qwen3, make_tokenizer, with_lora

MODELS = {
    "llama": lambda tok: make_model(tok, hidden=64),
    "qwen3": make_qwen3,
    "gemma3": make_gemma3,
    "lora": lambda tok: with_lora(make_model(tok, hidden=64), modules_to_save=["lm_head"]),
}


def setup(device="cpu", family="llama", **kw):
    tok = make_tokenizer()
    model = MODELS[family](tok).eval().to(device)
    sampling = SamplingSettings(max_completion_length=kw.pop("max_completion_length", 16), **kw)
    stop = end_of_turn_ids(tok, model.generation_config.eos_token_id)
    chats = [[{"role": "user", "content": text}] for text in ("hi", "what is two plus two?")]
    rows = as_requests([ids for ids in tokenize_prompts(chats, tok) for _ in range(4)])
    return tok, model, sampling, stop, rows


def greedy(logprobs):
    return logprobs.argmax(-1)
