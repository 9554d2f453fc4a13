"""Clear errors, not tracebacks (#32 item 11): `grpo train` given a config file that is not a mapping of fields,
an integer field given a fraction, `grpo report` on metrics too large for a chart, and a reward model given a
sequence longer than the positions it can embed."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from grpo import GRPOConfig, cli
from grpo.observe.report import charts
from grpo.rewards.models import RewardModel
from grpo.train_cli import parse
from support.reports import charts_in, full_history, write_run
from support.tiny import make_tokenizer

# ---- (a) grpo train: the config file --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, problem",
    [
        ("max_steps: [1\n  foo: bar\n", r"bad\.yaml is not valid YAML \(line 2, column 6: expected ',' or ']'"),
        ("null\n", r"bad\.yaml holds null, not a mapping of field: value"),
        ("", r"bad\.yaml is empty, not a mapping of field: value"),
        ("- max_steps\n- 5\n", r"bad\.yaml holds a list, not a mapping of field: value"),
        ("'max_steps'\n", r"bad\.yaml holds a str, not a mapping of field: value"),
        ("1: 2\n", r"bad\.yaml: the key 1 is not a field name"),
        ("max_steps: 1.5\n", r"bad\.yaml: GRPOConfig\.max_steps is 1\.5; it must be a whole number"),
        ("seed: 0.5\n", r"bad\.yaml: GRPOConfig\.seed is 0\.5; it must be a whole number"),
    ],
)
def test_a_config_file_that_is_not_a_mapping_of_fields_is_one_usage_error(tmp_path, capsys, text, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^grpo train: \S*" + problem, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_missing_config_file_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err


def test_other_command_line_mistakes_exit_with_the_same_status(tmp_path, capsys):
    """The messages grpo train already had (an unknown field, ...) exit with argparse's status 2 too."""
    path = tmp_path / "recipe.yaml"
    path.write_text("num_generation: 4\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    assert "unknown field 'num_generation'; did you mean 'num_generations'" in capsys.readouterr().err
    path.write_text("max_steps: 3\n")  # a value refused from a flag names the field, not the file
    assert cli.main(["train", "--config", str(path), "--num_generations", "1"]) == 2
    assert re.match(r"grpo train: GRPOConfig\.num_generations is 1; GRPO compares", capsys.readouterr().err)
    with pytest.raises(SystemExit) as argparse_exit:  # argparse's own usage error, for comparison
        cli.main(["train", "--max_steps", "1.5"])
    assert argparse_exit.value.code == 2 and "invalid int value: '1.5'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ("logging_steps: null", "logging_steps needs a number, not null"),
        ("learning_rate: [0.001]", "learning_rate needs a number, not the list [0.001]"),
        ("bf16: 3", "bf16 needs true or false or null, not the number 3"),
        ("report_to: [wandb, null]", "report_to needs null or a string or a list of strings, not the list"),
        ("lr_scheduler_type: [cosine]", "lr_scheduler_type needs a string, not the list ['cosine']"),
    ],
)
def test_a_config_value_of_the_wrong_kind_names_the_field_and_the_kind(tmp_path, capsys, text, message):
    """YAML values skip argparse's conversion: one of the wrong kind is named with the kind its field needs (it
    used to surface as "'>' not supported between instances of 'NoneType' and 'int'"); values of the right
    kind, and strings argparse converts (YAML reads 1e-5 as one), still parse."""
    path = tmp_path / "recipe.yaml"
    path.write_text(text + "\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    assert f"grpo train: {path}: {message}" in capsys.readouterr().err
    path.write_text("learning_rate: 1e-5\nreward_weights: [1.0, 0.5]\nmodel_init_kwargs: {dtype: float32}\n")
    _, args, _ = parse(["--config", str(path)])
    assert args.learning_rate == 1e-5 and args.reward_weights == [1.0, 0.5]


# ---- (b) integer fields ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_steps", "per_device_train_batch_size", "num_generations", "top_k", "seed"])
def test_an_integer_field_given_a_fraction_is_refused(name):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{name} is 2\.5; it must be a whole number"):
        GRPOConfig(output_dir="x", **{name: 2.5})


def test_a_whole_float_is_taken_as_its_int_and_ratio_fields_keep_their_fractions():
    c = GRPOConfig(output_dir="x", max_steps=4.0, num_generations=4.0, per_device_train_batch_size=8.0)
    assert (c.max_steps, c.num_generations) == (4, 4) and type(c.max_steps) is int
    assert type(c.per_device_train_batch_size) is int
    # float fields in the HF Trainer: below 1 a ratio of the run (save_steps, logging_steps, eval_steps, warmup)
    c = GRPOConfig(output_dir="x", save_steps=0.25, logging_steps=0.1, eval_steps=0.5, warmup_steps=0.1)
    assert (c.save_steps, c.logging_steps, c.eval_steps, c.warmup_steps) == (0.25, 0.1, 0.5, 0.1)


# ---- (c) grpo report on numbers no chart can hold -------------------------------------------------------------


@pytest.mark.parametrize("huge", [int("9" * 400), 1.7e308, -1.7e308, 1e301])
def test_a_metric_too_large_for_a_chart_is_noted_not_a_crash(tmp_path, capsys, huge):
    rows = full_history(4)
    rows[1]["reward"] = huge
    rows[2]["reward"] = -huge
    for row in rows[:4]:  # every grad_norm too large: its chart (a log scale) has no line at all
        row["grad_norm"] = abs(huge)
    rows[4]["eval_reward"] = huge
    out = write_run(tmp_path / "run", rows, info={})
    assert cli.main(["report", out]) == 0, capsys.readouterr().err
    page = (tmp_path / "run" / "report.html").read_text()
    drawn = charts_in(page)
    assert drawn["Reward"] == 2 and "3 values too large to draw (|x| &gt; 1e300) are left out" in page
    assert drawn["Gradient norm"] == 0 and "4 values too large to draw" in page
    assert drawn["Evaluation"] == 1 and "1 value too large to draw (|x| &gt; 1e300) is left out" in page
    assert "nan" not in page and "inf<" not in page


def test_the_chart_bounds_hold_at_the_limit():
    rows = [{"step": 1, "reward": 1e300}, {"step": 2, "reward": -1e300}, {"step": 3, "reward": 1.7e308}]
    (chart,) = [c for c in charts.charts(rows) if c.title == "Reward"]
    svg = charts.render(chart, rows)
    assert charts.data_points(chart, rows) == 2 and "1 value too large to draw" in svg


# ---- (d) reward models past their positions ---------------------------------------------------------------------


def gpt2_judge(tok, positions=16):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=positions, n_embd=16, n_layer=1, n_head=2, num_labels=1)
    config.pad_token_id = tok.pad_token_id
    return GPT2ForSequenceClassification(config).eval()


def roberta_judge(tok, positions=18):
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=positions,  # RoBERTa's positions start after the pad id: room for 18 - 1 - 1
        pad_token_id=tok.pad_token_id,
        num_labels=1,
    )
    return RobertaForSequenceClassification(config).eval()


@pytest.mark.parametrize("make, limit", [(gpt2_judge, 16), (roberta_judge, 18 - make_tokenizer().pad_token_id - 1)])
def test_a_reward_model_refuses_a_sequence_past_its_positions_by_name(make, limit):
    tok = make_tokenizer()
    rm = RewardModel(make(tok), tok)
    fits, longer = "a" * (limit - 3), "b" * (limit - 2)  # one token per character; the prompt "abc" adds 3
    assert len(rm(prompts=["abc"], completions=[fits])) == 1  # exactly at the limit: scored
    with pytest.raises(
        ValueError, match=rf"reward model {rm.__name__}: completion 1 \(with its prompt\) is {limit + 1} tokens"
    ):
        rm(prompts=["abc", "abc"], completions=[fits, longer])
    with pytest.raises(ValueError, match=rf"embeds at most {limit} positions"):
        rm(prompts=["abc"], completions=["c" * 500])


def test_a_reward_model_with_computed_positions_scores_any_length_as_trl():
    """RoPE (Llama) computes positions: nothing indexes past a table, and TRL (no truncation) scores it whole."""
    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    rm = RewardModel(LlamaForSequenceClassification(config).eval(), tok)
    assert len(rm(prompts=["abc"], completions=["d" * 40])) == 1


# ---- vLLM's errors: the line that says what failed ------------------------------------------------------------


def test_a_vllm_error_is_named_by_its_message_not_its_closing_link():
    """vLLM refuses an architecture it cannot build with a pydantic validation error, whose last line is a link (a
    Qwen3.5 on vLLM's CPU build); the engine's one-line error names the message. Other errors: their last line."""
    from grpo.rollout.vllm import error_reason

    pydantic = ValueError(
        "1 validation error for ModelConfig\n  Value error, Model architectures ['Qwen3_5ForCausalLM'] failed to be "
        "inspected. Please check the logs for more details. [type=value_error, input_value=ArgsKwargs((), {}), "
        "input_type=ArgsKwargs]\n    For further information visit https://errors.pydantic.dev/2.14/v/value_error"
    )
    assert error_reason(pydantic) == (
        "Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected. Please check the logs for more details."
    )
    assert error_reason(RuntimeError("deep in the stack\nno kernel for head_dim=8")) == "no kernel for head_dim=8"
    assert error_reason(KeyError()) == "KeyError"
