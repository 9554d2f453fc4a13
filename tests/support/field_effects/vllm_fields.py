"""Effects of the vLLM (colocate) and importance-sampling fields. vLLM itself runs in tests/with_vllm (a process of its
own); here the engine's settings are read from the functions that build them (`engine_kwargs`, `sampling_kwargs`),
the trainer runs with a recording stand-in for the vLLM engine (its samples are the fast engine's, with log-probs
shifted as a mismatched sampler's would be), and the correction's numbers come from `SamplingCorrection`."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from support.field_effects import Setting, effect

SHIFT = 0.1  # the stand-in sampler's log-probs are the policy's minus this, per token


class RecordingVLLM:
    """Stands in for `grpo.rollout.VLLMEngine`: records how it was built and synced; samples with the fast engine
    and reports log-probs SHIFT lower than the policy's, so the correction has a mismatch to correct."""

    name = "vllm"
    samples_elsewhere = True
    built: list[dict] = []

    def __init__(self, model, tokenizer, sampling, settings, stop_ids, **kwargs):
        from grpo.rollout.fast import FastEngine

        self.inner = FastEngine(model, tokenizer, sampling, stop_ids)
        self.syncs = 0
        self.generated_after_sync = []
        RecordingVLLM.built.append(dict(kwargs, sampling=sampling, settings=settings))

    def sync_weights(self, model):
        self.syncs += 1

    def generate(self, requests):
        self.generated_after_sync.append(self.syncs > 0)
        rollout = self.inner.generate(requests)
        rollout.sampling_logps = [[lp - SHIFT for lp in row] for row in rollout.sampling_logps]
        return rollout


def with_recording_vllm():
    RecordingVLLM.built = []
    return mock.patch("grpo.rollout.VLLMEngine", RecordingVLLM)


def _engine_kwargs(s: Setting, device: str = "cpu", default: bool = False):
    """vllm.LLM's keyword arguments for the setting's config (or, with `default`, the field at its default)."""
    from grpo.algo.sampling import SamplingSettings
    from grpo.rollout.vllm import VLLMSettings, engine_kwargs

    config = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, max_position_embeddings=512
    )
    args = s.default_config() if default else s.config()
    settings, sampling = VLLMSettings.of(args), SamplingSettings.of(args)
    return engine_kwargs(settings, sampling, SimpleNamespace(config=config), torch.float32, device, 0, 8)


def _correction(config):
    """(rho, sampler_logps, stats) of the config's correction on a fixed 2 x 3 batch whose sampler log-probs are
    lower than the trainer's by 0.5 per token (row 1's last token is padding)."""
    from grpo.algo.sampling_correction import SamplingCorrection

    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    sampling = (trainer - 0.5) * mask
    engine = SimpleNamespace(samples_elsewhere=True)
    return SamplingCorrection.of(config, engine)(trainer, None, sampling, mask)


@effect("use_vllm", True)
def _use_vllm(s: Setting):
    with with_recording_vllm():
        trainer = s.train(max_steps=2)
    assert isinstance(trainer.engine, RecordingVLLM)
    built = RecordingVLLM.built[0]
    assert built["rows"] == 8 and built["device"] == "cpu" and built["dtype"] == torch.float32
    # synced before the first generation and again after the first optimizer step
    assert trainer.engine.generated_after_sync == [True, True] and trainer.engine.syncs == 2
    row = trainer.state.log_history[-1]
    # the stand-in's mismatch is corrected: a sequence ratio of exp(0.1 x tokens) per row, none above 3 here
    assert row["sampling/importance_sampling_ratio/mean"] > 1.05
    assert abs(row["sampling/sampling_logp_difference/mean"] - SHIFT) < 1e-4
    assert trainer.parts.correction.apply and trainer.parts.correction.external


@effect("vllm_model_impl", "transformers")
def _model_impl(s: Setting):
    assert _engine_kwargs(s)["model_impl"] == "transformers"


@effect("vllm_enable_sleep_mode", True)
def _sleep_mode(s: Setting):
    assert _engine_kwargs(s, "cuda")["enable_sleep_mode"] is True
    with with_recording_vllm(), pytest.raises(ValueError, match="vLLM's CPU build has no sleep mode"):
        s.trainer(use_vllm=True)


@effect("vllm_tensor_parallel_size", 2)
def _tensor_parallel(s: Setting):
    kwargs = _engine_kwargs(s)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["max_num_seqs"] == 16  # the engine generates both processes' rows
    assert "distributed_executor_backend" not in _engine_kwargs(s, default=True)
    with with_recording_vllm(), pytest.raises(ValueError, match="tensor_parallel_size=2 .* this run has 1"):
        s.trainer(use_vllm=True)  # one process cannot hold a two-process engine
    assert RecordingVLLM.built == []
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("grpo").addHandler(handler)
    try:  # server mode: a colocate setting, said so (1.16 ignores it silently)
        _no_server_error(s, vllm_server_port=_free_port())
    finally:
        logging.getLogger("grpo").removeHandler(handler)
    assert any("grpo vllm-serve --tensor-parallel-size" in r.getMessage() for r in records)


@effect("vllm_structured_outputs_regex", "[0-9]+")
def _regex(s: Setting):
    from grpo.algo.sampling import SamplingSettings
    from grpo.rollout.vllm import sampling_kwargs

    assert sampling_kwargs(SamplingSettings.of(s.config()), [1, 5])["structured_outputs"] == {"regex": "[0-9]+"}


@effect("vllm_gpu_memory_utilization", 0.5)
def _gpu_memory(s: Setting):
    assert _engine_kwargs(s, "cuda")["gpu_memory_utilization"] == 0.5
    assert "kv_cache_memory_bytes" not in _engine_kwargs(s, "cuda")
    assert "kv_cache_memory_bytes" in _engine_kwargs(s, "cpu")  # a CPU sizes the cache itself


@effect("vllm_max_model_length", 64)
def _max_model_length(s: Setting):
    assert _engine_kwargs(s)["max_model_len"] == 64
    with with_recording_vllm():
        trainer = s.trainer(use_vllm=True)
    assert trainer.parts.prompts.context == 64  # a longer prompt is refused, naming its row


@effect("vllm_importance_sampling_correction", False)
def _correction_off(s: Setting):
    rho, sampler, stats = _correction(s.config(use_vllm=True))
    assert rho is None and sampler is not None  # OPSM still reads vLLM's log-probs
    on, _, _ = _correction(s.default_config(use_vllm=True))
    assert on is not None and stats["sampling/importance_sampling_ratio/mean"].local() == pytest.approx(
        on.mean().item()
    )


@effect("vllm_importance_sampling_mode", "token_truncate")
def _mode(s: Setting):
    rho, _, _ = _correction(s.config())
    assert rho.shape == (2, 3)
    assert torch.allclose(rho, torch.tensor([[1.6487, 1.6487, 1.6487], [1.6487, 1.6487, 1.0]]), atol=1e-4)
    default, _, _ = _correction(s.default_config())
    assert default.shape == (2, 1) and default[0, 0] == 0.0  # sequence_mask: exp(1.5) > 3 is masked


@effect("vllm_importance_sampling_clip_max", 5.0)
def _clip_max(s: Setting):
    rho, _, _ = _correction(s.config())
    assert rho[0, 0].item() == pytest.approx(torch.e**1.5, rel=1e-5)  # under 5: kept, where 3 masked it
    assert rho[1, 0].item() == pytest.approx(torch.e**1.0, rel=1e-5)


@effect("vllm_importance_sampling_clip_min", 2.8)
def _clip_min(s: Setting):
    rho, _, stats = _correction(s.config())
    assert rho[1, 0].item() == 0.0  # exp(1.0) < 2.8: masked
    assert stats["sampling/importance_sampling_ratio/clipped_fraction"].local() == 1.0


@effect("off_policy_mask_threshold", 0.1)
def _opsm(s: Setting):
    from grpo.algo.losses import LossParams, policy_loss

    logps = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    sampler = logps.detach() + 0.5  # drifted by 0.5 per token: above the threshold
    mask, adv = torch.ones(2, 2), torch.tensor([1.0, -1.0])
    params = LossParams.of(s.config())
    assert params.off_policy_mask_threshold == 0.1
    loss, _ = policy_loss(logps, None, adv, mask, params, sampler_logps=sampler)
    loss.backward()
    assert logps.grad[1].abs().sum() == 0 and logps.grad[0].abs().sum() > 0  # the negative row is dropped
    default, _ = policy_loss(logps, None, adv, mask, LossParams.of(s.default_config()), sampler_logps=sampler)
    assert default.item() != loss.item()


@effect("vllm_importance_sampling_cap", 2.0)
def _cap(s: Setting):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = s.config()
    assert config.vllm_importance_sampling_clip_max == 2.0
    assert any(issubclass(w.category, FutureWarning) and "deprecated" in str(w.message) for w in caught)


@effect("vllm_enforce_eager", False)
def _eager(s: Setting):
    assert _engine_kwargs(s)["enforce_eager"] is False
    assert _engine_kwargs(s, "cuda")["enforce_eager"] is False
    assert _engine_kwargs(s, default=True)["enforce_eager"] is True  # None: eager on a CPU
    assert "enforce_eager" not in _engine_kwargs(s, "cuda", default=True)  # vLLM's own default on GPUs


@effect("vllm_kv_cache_gib", 0.5)
def _kv_cache(s: Setting):
    assert _engine_kwargs(s)["kv_cache_memory_bytes"] == 2**29
    sized = _engine_kwargs(s, default=True)["kv_cache_memory_bytes"]
    # the default: 8 rows of 512 + max_completion_length tokens, x4, at 2 layers x 2 kv heads x 32 x 4 bytes x 2
    assert sized == 2 * 2 * 2 * 32 * 4 * 4 * 8 * (512 + s.config().max_completion_length)


def _no_server_error(s: Setting, **more) -> str:
    """The error of a server-mode trainer with no server listening (the wait is cut to 0.2 s)."""
    from grpo.rollout.remote import ServerError

    more = {"use_vllm": True, "vllm_mode": "server", "vllm_server_timeout": 0.2, **more}
    with pytest.raises(ServerError, match="No vLLM server answered at") as caught:
        s.trainer(**more)
    return str(caught.value)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@effect("vllm_mode", "server")
def _server_mode(s: Setting):
    message = _no_server_error(s, vllm_server_port=_free_port())
    assert "grpo vllm-serve --model" in message and "vllm_mode='colocate'" in message


@effect("vllm_server_base_url", "http://127.0.0.1:1/v")
def _base_url(s: Setting):
    assert "at http://127.0.0.1:1/v within" in _no_server_error(s, vllm_server_host="127.0.0.9")


@effect("vllm_server_host", "127.0.0.9")
def _host(s: Setting):
    port = _free_port()
    assert f"at http://127.0.0.9:{port} within" in _no_server_error(s, vllm_server_port=port)


@effect("vllm_server_port", 1)
def _port(s: Setting):
    assert "at http://0.0.0.0:1 within" in _no_server_error(s)


@effect("vllm_server_timeout", 0.3)
def _timeout(s: Setting):
    from grpo.rollout.remote import ServerError

    with pytest.raises(ServerError, match=r"within vllm_server_timeout=0.3 s"):
        s.trainer(use_vllm=True, vllm_mode="server", vllm_server_port=1)


@effect("vllm_group_port", 52000)
def _group_port(s: Setting):
    """Server i's weight-transfer group listens on the first free port from vllm_group_port + i (a stub server:
    the check stops at the port, before vLLM is imported)."""
    import grpo.rollout.remote as remote

    asked = []

    class Stop(Exception):
        pass

    def first_free(port):
        asked.append(port)
        raise Stop

    facts = {"model": "m", "dtype": "float32", "max_model_len": 64, "backend": "gloo", "world_size": 1}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(remote.ServerClient, "describe", lambda self, tokenizer: dict(facts))
        patch.setattr(remote, "free_port", first_free)
        trainer = s.trainer(
            use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:1,http://127.0.0.1:2"
        )
        with pytest.raises(remote.ServerError, match=r"from vllm_group_port \+ 0 = 52000\): Stop"):
            trainer.engine.sync_weights(trainer.unwrapped_model)
    assert asked == [52000]


@effect("vllm_server_api_key", "s3cret")
def _api_key(s: Setting):
    config = s.config(use_vllm=True, vllm_mode="server")
    assert config.vllm_server_api_key == "s3cret" and config.to_dict()["vllm_server_api_key"] == "<redacted>"
