"""Secrets (Hub tokens, the vLLM server key, any token-like value at any depth) never reach what grpo writes or
shows: the model card, report.html, run_info.json, checkpoints, repr(args). The real values still load the model
and reach the Hub."""

from __future__ import annotations

import collections
import json
from unittest import mock

from grpo import GRPOConfig, GRPOTrainer
from grpo.base.secrets import PLACEHOLDER, is_secret_key, redact, redact_text
from grpo.models import modeling
from grpo.observe import report
from grpo.observe.report import record
from support.hub import FakeApi
from support.reports import full_history, write_run
from support.rewards import length_reward
from support.runs import cfg, chat_dataset

HF_TOKEN = "hf_" + "abcdefghijklmnopqrstuvwxyzABCDEFGH"  # "hf_" and 34 letters: a Hugging Face token's shape
HUB_TOKEN = "hf_" + "ZYXWVUTSRQPONMLKJIHGFEDCBAzyxwvuts"
SERVER_KEY = "server-key-0123456789"


def test_values_under_secret_keys_are_redacted_at_any_depth():
    value = {
        "token": "abc",
        "nested": [{"Api-Key": "k1"}, ({"HUB_TOKEN": "k2"},), {"deeper": {"password": "p", "Authorization": "x"}}],
        "client_secret": "s",
        "use_auth_token": True,  # names no token: kept
        "hub_token": None,
        "pad_token_id": 0,
        "max_new_tokens": 8,
        "eos_token": "",
        "format_key": 0.5,  # a number (a reward function's name in a completions table): kept
    }
    out = redact(value)
    assert out["token"] == PLACEHOLDER and out["client_secret"] == PLACEHOLDER
    assert out["nested"][0] == {"Api-Key": PLACEHOLDER} and out["nested"][1] == ({"HUB_TOKEN": PLACEHOLDER},)
    assert out["nested"][2]["deeper"] == {"password": PLACEHOLDER, "Authorization": PLACEHOLDER}
    assert out["use_auth_token"] is True and out["hub_token"] is None and out["eos_token"] == ""
    assert out["pad_token_id"] == 0 and out["max_new_tokens"] == 8 and out["format_key"] == 0.5
    assert value["token"] == "abc" and value["nested"][0]["Api-Key"] == "k1"  # a copy: the input is untouched


def test_token_shaped_strings_are_redacted_wherever_they_sit():
    text = f"see https://x.org/?q={HF_TOKEN} and Authorization: Bearer abc.def-123 end"
    assert redact_text(text) == f"see https://x.org/?q={PLACEHOLDER} and Authorization: Bearer {PLACEHOLDER} end"
    assert redact_text("hf_short and hf_underscores_are_not_a_token") == "hf_short and hf_underscores_are_not_a_token"
    point = collections.namedtuple("point", "name value")
    out = redact({"run": [f"name-{HF_TOKEN}"], "pair": point("bearer", "bearer xyz"), "set": {HF_TOKEN}})
    assert out["run"] == [f"name-{PLACEHOLDER}"] and out["set"] == {PLACEHOLDER}
    assert out["pair"] == point("bearer", f"bearer {PLACEHOLDER}") and type(out["pair"]) is point


def test_a_secret_under_a_key_is_also_removed_where_else_it_appears():
    out = redact({"api_key": SERVER_KEY, "url": f"http://host/?k={SERVER_KEY}", "word": "short"}, known=["short"])
    assert out == {"api_key": PLACEHOLDER, "url": f"http://host/?k={PLACEHOLDER}", "word": "short"}  # < 8: kept
    assert is_secret_key("vllm_server_api_key") and is_secret_key("X-Api-Key") and not is_secret_key("tokens")


def test_config_repr_str_and_to_dict_redact_nested_secrets_but_keep_the_values(tmp_path):
    args = cfg(
        tmp_path,
        model_init_kwargs={"token": HF_TOKEN, "revision": "main"},
        hub_token=HUB_TOKEN,
        vllm_server_api_key=SERVER_KEY,
    )
    for shown in (repr(args), str(args), json.dumps(args.to_dict())):
        assert HF_TOKEN not in shown and HUB_TOKEN not in shown and SERVER_KEY not in shown
    assert repr(args).startswith("GRPOConfig(") and "learning_rate=0.01" in repr(args) and PLACEHOLDER in repr(args)
    assert args.to_dict()["model_init_kwargs"] == {"token": PLACEHOLDER, "revision": "main"}
    assert args.to_dict()["hub_token"] == PLACEHOLDER and args.to_dict()["vllm_server_api_key"] == PLACEHOLDER
    assert args.model_init_kwargs["token"] == HF_TOKEN and args.hub_token == HUB_TOKEN  # the real values stay
    assert GRPOConfig(output_dir=str(tmp_path)).to_dict()["hub_token"] is None  # unset stays unset


def test_no_file_of_a_run_holds_a_secret_and_the_model_still_gets_the_token(tiny_model_dir, tmp_path, monkeypatch):
    """A short run with a token in model_init_kwargs, hub_token, the server key and a token-shaped run name,
    checkpoints, the report, the card and a push: not one byte under output_dir holds any of them."""
    loaded = []
    real = modeling.from_pretrained_checked

    def recording(auto_class, kind, model_id, **kwargs):
        loaded.append((kind, kwargs.get("token")))
        return real(auto_class, kind, model_id, **kwargs)

    monkeypatch.setattr(modeling, "from_pretrained_checked", recording)
    args = cfg(
        tmp_path,
        model_init_kwargs={"token": HF_TOKEN},
        hub_token=HUB_TOKEN,
        vllm_server_api_key=SERVER_KEY,
        run_name=f"run-{HF_TOKEN}",
        push_to_hub=True,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        log_completions=True,
    )
    FakeApi.calls, FakeApi.fail = [], False
    with mock.patch("huggingface_hub.HfApi", FakeApi):
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
        trainer.train()
        trainer.push_to_hub()
    assert ("model", HF_TOKEN) in loaded  # from_pretrained got the real token
    assert FakeApi.calls[0][3] == HUB_TOKEN  # and so did the Hub
    out = tmp_path / "out"
    written = [p for p in out.rglob("*") if p.is_file()]
    names = {p.relative_to(out).as_posix() for p in written}
    assert {"README.md", "report.html", "run_info.json", "checkpoint-2/trainer_state.json"} <= names
    assert {"checkpoint-2/README.md", "completions/completions_00002.parquet"} <= names
    for secret in (HF_TOKEN, HUB_TOKEN, SERVER_KEY):
        assert [p.relative_to(out).as_posix() for p in written if secret.encode() in p.read_bytes()] == []
    info = json.loads((out / "run_info.json").read_text())
    assert info["config"]["model_init_kwargs"] == {"token": PLACEHOLDER}  # the setting is still shown, redacted
    assert PLACEHOLDER in (out / "README.md").read_text()


def test_a_report_rebuilt_from_an_older_run_info_shows_no_secret(tmp_path):
    """run_info.json written before redaction (or by hand): `grpo report` still shows no token."""
    config = {"hub_token": HUB_TOKEN, "model_init_kwargs": {"token": "plain-secret-value"}}
    info = {"config": config, "status": "stopped"}
    info["ended"] = {"step": 3, "time": "t", "error": f"OSError: 401 for Bearer {SERVER_KEY}"}
    completions = {3: [{"prompt": f"say {HF_TOKEN}", "completion": "ok", "advantage": 0.1}]}
    out = write_run(tmp_path / "run", full_history(3), completions=completions, info=info)
    html = open(report.rebuild(out)).read()
    assert not [s for s in (HUB_TOKEN, HF_TOKEN, SERVER_KEY, "plain-secret-value") if s in html]
    assert "redacted" in html
    assert record.read_info(out)["config"]["hub_token"] == PLACEHOLDER
