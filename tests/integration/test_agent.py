"""Agent training through the trainer: the tool loop on scripted engines (completions we choose), the trained
sequence and its masks, the iteration and token limits, failures and metrics, environment_factory, rollout_func,
the gradient of tool tokens, and the completions log."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from datasets import Dataset

from grpo import GRPOTrainer
from grpo.agent import CHATML_TOOLS
from grpo.algo.losses import policy_loss
from grpo.learner.batch import collate
from support.agent import CALL, GROUPS, Counter, cfg, dataset, final_is_6, make_trainer, multiply, tool_tokenizer
from support.runs import generate
from support.scripted import TurnScript
from support.tiny import make_model, make_tokenizer

CALLED = {"name": "multiply", "arguments": {"a": 2, "b": 3}}


def call_then_answer(text, turn, j):
    """Even samples call multiply then answer 6; odd ones answer at once."""
    if turn == 0 and j % 2 == 0:
        return CALL
    return "6"


def test_the_trained_sequence_is_the_sampled_tokens_plus_the_tool_turns(tmp_path):
    trainer = make_trainer(tmp_path, call_then_answer)
    tok, engine = trainer.processing_class, trainer.engine
    rollout = generate(trainer, GROUPS).rollout
    first, second = engine.turn_ids(CALL), engine.turn_ids("6")
    suffix = tok("\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for i in range(8):
        if i % 2 == 0:  # request j = i % 4 within the group of 4
            assert rollout.completion_ids[i] == first + suffix + second
            assert rollout.loss_mask[i] == [1] * len(first) + [0] * len(suffix) + [1] * len(second)
            assert rollout.sampling_logps[i] == [-0.5] * len(first) + [0.0] * len(suffix) + [-0.5] * len(second)
            assert rollout.messages[i] == [
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALLED}]},
                {"role": "tool", "name": "multiply", "content": "6"},
                {"role": "assistant", "content": "6"},
            ]
            assert rollout.tool_calls[i] == 1 and rollout.tool_failures[i] == 0
        else:
            assert rollout.completion_ids[i] == second and rollout.loss_mask[i] == [1] * len(second)
            assert rollout.messages[i] == [{"role": "assistant", "content": "6"}] and rollout.tool_calls[i] == 0
    # the follow-up turn was asked of the engine with the whole sequence so far, one sample per row
    follow_ups = engine.requests[1]
    assert [r.num_samples for r in follow_ups] == [1] * 4
    assert list(follow_ups[0].prompt.ids) == rollout.prompt_ids[0] + first + suffix
    assert follow_ups[0].max_tokens == 200 - len(first) - len(suffix)
    # the prompt was rendered with the tool's schema
    assert '"name": "multiply"' in tok.decode(rollout.prompt_ids[0])
    # the training batch masks the tool tokens out
    batch = collate(rollout, torch.zeros(8), tok.pad_token_id, False)
    assert batch.mask[0].tolist()[: len(rollout.loss_mask[0])] == [float(m) for m in rollout.loss_mask[0]]
    assert batch.completion_attention[0, : len(rollout.loss_mask[0])].tolist() == [1] * len(rollout.loss_mask[0])


def test_a_template_that_rerenders_earlier_turns_trains_the_sampled_tokens(tmp_path):
    """Qwen3's template drops an earlier assistant turn's reasoning once more turns follow (not prefix-preserving):
    the trained sequence still is the sampled tokens plus the template's own tool turn, nothing re-rendered."""
    trainer = make_trainer(tmp_path, call_then_answer, args={"max_steps": 1})
    tok, engine = trainer.processing_class, trainer.engine
    tok.chat_template = CHATML_TOOLS.replace(  # the last assistant turn shows a reasoning block, earlier ones not
        "{% for call in message.get('tool_calls') or [] %}",
        "{% if loop.last %}<think></think>{% endif %}{% for call in message.get('tool_calls') or [] %}",
    )
    rollout = generate(trainer, GROUPS).rollout
    first, second = engine.turn_ids(CALL), engine.turn_ids("6")
    suffix = tok("\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert rollout.completion_ids[0] == first + suffix + second
    assert rollout.loss_mask[0] == [1] * len(first) + [0] * len(suffix) + [1] * len(second)
    trainer.train()
    assert trainer.state.log_history[-1]["tools/call_frequency"] == 0.5


def test_training_logs_tool_metrics_and_lengths_of_model_tokens_only(tmp_path):
    trainer = make_trainer(tmp_path, call_then_answer)
    trainer.train()
    row = trainer.state.log_history[-1]
    assert row["tools/call_frequency"] == 0.5 and row["tools/failure_frequency"] == 0.0
    engine = trainer.engine
    model_tokens = [len(engine.turn_ids(CALL)) + len(engine.turn_ids("6")), len(engine.turn_ids("6"))]
    assert row["completions/mean_length"] == sum(model_tokens) / 2
    assert row["reward"] == 0.5 and row["frac_reward_zero_std"] == 0.0


def test_iteration_limit_ends_the_loop_with_the_last_call_unexecuted(tmp_path):
    trainer = make_trainer(
        tmp_path, lambda text, turn, j: CALL, args=dict(max_tool_calling_iterations=2, max_completion_length=400)
    )
    rollout = generate(trainer, GROUPS).rollout
    roles = [m["role"] for m in rollout.messages[0]]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert rollout.messages[0][-1]["tool_calls"] and rollout.tool_calls == [2] * 8
    assert len(trainer.engine.requests) == 3  # the first turn and two rounds


def test_no_limit_runs_until_the_token_budget(tmp_path):
    """max_tool_calling_iterations=None: a model that always calls stops when the next results would leave no
    room for another token; those results are then not added (the call counts: it ran)."""
    trainer = make_trainer(tmp_path, lambda text, turn, j: CALL, args=dict(max_completion_length=280))
    rollout = generate(trainer, GROUPS).rollout
    call, suffix = len(trainer.engine.turn_ids(CALL)), 21  # tokens of a call turn and of a tool turn
    assert [len(ids) for ids in rollout.completion_ids] == [3 * call + 2 * suffix] * 8  # a 3rd result would not fit
    assert 3 * call + 3 * suffix >= 280 > 3 * call + 2 * suffix
    assert [m["role"] for m in rollout.messages[0]] == ["assistant", "tool"] * 2 + ["assistant"]
    assert rollout.messages[0][-1]["tool_calls"] and rollout.tool_calls == [3] * 8


def test_a_turn_cut_by_the_budget_is_truncated(tmp_path):
    long_answer = "x" * 400
    trainer = make_trainer(tmp_path, lambda text, turn, j: CALL if turn == 0 else long_answer)
    rollout = generate(trainer, GROUPS).rollout
    assert all(len(ids) == 200 for ids in rollout.completion_ids) and all(rollout.truncated)
    assert rollout.messages[0][-1]["content"] == "x" * (
        200 - rollout.loss_mask[0].index(0) - rollout.loss_mask[0].count(0)
    )


def test_failing_tools_become_messages_and_count_as_failures(tmp_path):
    def fail(text, turn, j):
        if turn == 0:
            return [
                '<tool_call>{"name": "multiply", "arguments": {"a": 2}}</tool_call>',
                '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                CALL + '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>',
                '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}</tool_call>',  # not JSON: text
            ][j]
        return "6"

    def boom(x: int) -> int:
        """Raises.

        Args:
            x: x
        """
        raise ValueError("no")

    trainer = make_trainer(tmp_path, fail, tools=(multiply, boom))
    trainer.train()
    row = trainer.state.log_history[-1]
    # per group: 1 + 1 + 2 calls (the unparsable one is text), of which 3 failed
    assert row["tools/call_frequency"] == 1.0 and row["tools/failure_frequency"] == 0.75
    rollout = generate(trainer, [0] * 4).rollout
    assert "missing a required argument" in rollout.messages[0][1]["content"]
    assert "Tool nope not found." in rollout.messages[1][1]["content"]
    assert [m["content"] for m in rollout.messages[2][1:3]] == ["6", str({"error": "no"})]
    assert rollout.messages[3] == [{"role": "assistant", "content": fail("", 0, 3)}]


def test_async_tools_and_a_hung_tool(tmp_path):
    import asyncio
    import threading

    release = threading.Event()

    async def amultiply(a: int, b: int) -> int:
        """Multiplies later.

        Args:
            a: x
            b: y
        """
        await asyncio.sleep(0.01)
        return a * b

    def stuck(x: int) -> int:
        """Never returns.

        Args:
            x: x
        """
        release.wait()
        return x

    def script(text, turn, j):
        if turn == 0:
            return [
                '<tool_call>{"name": "amultiply", "arguments": {"a": 2, "b": 3}}</tool_call>',
                '<tool_call>{"name": "stuck", "arguments": {"x": 1}}</tool_call>',
            ][j % 2]
        return "6"

    trainer = make_trainer(tmp_path, script, tools=(amultiply, stuck), args=dict(tool_call_timeout=0.3))
    rollout = generate(trainer, [0] * 4).rollout
    release.set()
    assert [m["content"] for m in rollout.messages[0]][1:] == ["6", "6"]
    assert "did not return within 0.3 s" in rollout.messages[1][1]["content"]
    assert rollout.tool_failures == [0, 1, 0, 1] and rollout.tool_calls == [1] * 4


def test_tool_tokens_give_exactly_zero_gradient_but_are_attended(tmp_path):
    trainer = make_trainer(tmp_path, call_then_answer)
    rollout = generate(trainer, GROUPS).rollout
    batch = collate(rollout, torch.linspace(-1, 1, 8), trainer.processing_class.pad_token_id, False)
    logps = trainer.training_pass.train(trainer.model, batch, entropy_grad=False).logps
    loss, _ = policy_loss(logps, None, batch.advantages, batch.mask, trainer.parts.loss_params)
    (grad,) = torch.autograd.grad(loss, logps)
    tool = (batch.completion_attention == 1) & (batch.mask == 0)
    assert tool.sum() > 0 and (grad[tool] == 0).all() and (grad[batch.mask == 1] != 0).any()
    # the model attends to the tool tokens: changing the tool result changes the log-probs of the answer after it
    changed = rollout.select(range(8))
    i = 0
    first_zero = changed.loss_mask[i].index(0)
    changed.completion_ids[i] = list(changed.completion_ids[i])
    changed.completion_ids[i][first_zero + 10] = trainer.processing_class.convert_tokens_to_ids("9")
    other = collate(changed, torch.zeros(8), trainer.processing_class.pad_token_id, False)
    with torch.no_grad():
        a = trainer.training_pass.train(trainer.model, batch, entropy_grad=False).logps
        b = trainer.training_pass.train(trainer.model, other, entropy_grad=False).logps
    answer = [k for k, m in enumerate(rollout.loss_mask[i]) if m == 1 and k > first_zero]
    assert not torch.equal(a[i, answer], b[i, answer])


def test_multi_turn_rollouts_as_token_trees_train_like_padded_rows(tmp_path):
    """packing="tree" with tools: each row's sampled turns and tool turns stay one completion (append-only), laid
    out in its prompt's tree; log-probs and gradients equal the padded rows'."""
    from grpo.learner.forward import token_logps
    from grpo.learner.layouts import PassSettings

    trainer = make_trainer(tmp_path, call_then_answer, args={"packing": "tree"})
    assert trainer.training_pass.tree
    rollout = generate(trainer, GROUPS).rollout
    batch = collate(rollout, torch.linspace(-1, 1, 8), trainer.processing_class.pad_token_id, False)
    batch = dataclasses.replace(batch, group=torch.tensor(GROUPS))
    assert ((batch.completion_attention == 1) & (batch.mask == 0)).sum() > 0  # tool tokens, attended, not trained

    def pass_(as_trees):
        trainer.model.zero_grad()
        logps = token_logps(
            trainer.model, batch, PassSettings(1.0, with_entropy=False, layouts=("trees" if as_trees else "padded",))
        ).logps
        (logps * batch.mask * batch.advantages.unsqueeze(1)).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    (padded, grads), (trees, tree_grads) = pass_(False), pass_(True)
    m = batch.completion_attention.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(tree_grads[name], grad, rtol=1e-5, atol=5e-6)
    trainer.train()  # and the trainer trains them so
    assert trainer.state.log_history[-1]["tools/call_frequency"] > 0


def test_completions_log_shows_the_whole_exchange(tmp_path):
    trainer = make_trainer(tmp_path, call_then_answer, args=dict(log_completions=True))
    trainer.train()
    table = pd.read_parquet(tmp_path / "out" / "completions" / "completions_00001.parquet")
    assert (table["completion"] == "<call multiply({'a': 2, 'b': 3})>\n[multiply -> 6]\n6").sum() == 4
    page = (tmp_path / "out" / "report.html").read_text()  # the run report shows the exchanges and tool metrics
    assert "&lt;call multiply({&#x27;a&#x27;: 2, &#x27;b&#x27;: 3})&gt;\n[multiply -&gt; 6]\n6" in page
    assert 'data-chart="Tool calls"' in page and "tools <b>multiply</b>" in page


def test_string_prompts_with_tools_are_refused(tmp_path):
    data = Dataset.from_list([{"prompt": "2*3?"}] * 8)
    with pytest.raises(ValueError, match="row 0: tools= need conversational prompts"):
        make_trainer(tmp_path, call_then_answer, data=data)


def test_the_document_template_check_runs_before_training(tmp_path):
    tok = make_tokenizer()  # plain ChatML: no tools
    with pytest.raises(ValueError, match="does not render the tools.*CHATML_TOOLS"):
        GRPOTrainer(
            model=make_model(tok),
            processing_class=tok,
            reward_funcs=final_is_6,
            train_dataset=dataset(),
            args=cfg(tmp_path),
            tools=[multiply],
        )


# ---- environment_factory -------------------------------------------------------------------------------------


def test_environment_factory_tools_reset_and_reward(tmp_path):
    Counter.made = 0
    seen = {}

    def script(text, turn, j):
        return '<tool_call>{"name": "add", "arguments": {"n": ' + str(j) + "}}</tool_call>" if turn == 0 else "done"

    def record(prompts, environments, **kw):
        seen.update(prompts=prompts, environments=environments)
        return [0.0] * len(prompts)

    tok = tool_tokenizer()
    trainer = GRPOTrainer(
        model=make_model(tok, context=4096),
        processing_class=tok,
        reward_funcs=record,
        train_dataset=dataset(),
        args=cfg(tmp_path, shuffle_dataset=False),
        environment_factory=Counter,
    )
    trainer.engine = TurnScript(tok, script)
    assert trainer.parts.rewards.names == ["record", "Counter"] and trainer.parts.rewards.weights.tolist() == [1.0, 1.0]
    trainer.train()
    # one instance per rollout (the probe included), each reset from its row and driven by its own calls
    assert Counter.made == 8 and [e.count for e in seen["environments"]] == [0, 1, 2, 3, 1, 2, 3, 4]
    assert seen["prompts"][0] == [{"role": "user", "content": "2*3 0 (start at 0)"}]
    row = trainer.state.log_history[-1]
    assert row["rewards/Counter/mean"] == 2.0 and row["tools/call_frequency"] == 1.0
    assert '"name": "add"' in tok.decode(trainer.engine.requests[0][0].prompt.ids)
    trainer.train()  # a second round reuses the pool
    assert Counter.made == 8


class Other(Counter):
    def get_reward(self):
        return -1.0


def test_environments_by_row_and_their_errors(tmp_path):
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "go"}], "k": i + 1, "environment": "ab"[i % 2]} for i in range(8)]
    )
    trainer = make_trainer(
        tmp_path,
        lambda t, turn, j: "done",
        tools=(),
        reward=None,
        data=data,
        environment_factory={"a": Counter, "b": Other},
        args=dict(shuffle_dataset=False),
    )
    assert trainer.parts.rewards.names == ["Counter", "Other"]
    trainer.train()
    row = trainer.state.log_history[-1]
    assert row["rewards/Counter/mean"] == 1.0 and row["rewards/Other/mean"] == -1.0
    bad = Dataset.from_list([{"prompt": [{"role": "user", "content": "go"}], "k": 0, "environment": "c"}] * 8)
    trainer = make_trainer(tmp_path, call_then_answer, tools=(), data=bad, environment_factory={"a": Counter})
    with pytest.raises(ValueError, match="environment='c'.*not among the environments.*\\['a'\\]"):
        trainer.train()

    class NoReset:
        pass

    with pytest.raises(ValueError, match="NoReset.*has no reset method"):
        make_trainer(tmp_path, call_then_answer, environment_factory=NoReset)
    with pytest.raises(ValueError, match="No reward source"):
        make_trainer(tmp_path, call_then_answer, reward=None)


def test_an_environment_without_a_dataset(tmp_path):
    trainer = make_trainer(
        tmp_path,
        lambda t, turn, j: "done",
        tools=(),
        reward=None,
        data=None,
        environment_factory=Counter,
    )
    assert len(trainer.train_dataset) == 2  # generation_batch_size / num_generations empty prompts


# ---- rollout_func ---------------------------------------------------------------------------------------------


def test_rollout_func_replaces_generation_and_its_keys_reach_rewards(tmp_path):
    seen = {}

    def rollout_func(prompts, trainer):
        seen["prompts"] = prompts
        tok = trainer.processing_class
        ids = tok("abc", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        return {
            "prompt_ids": [[5, 6]] * len(prompts),
            "completion_ids": [ids] * len(prompts),
            "logprobs": [[-0.1] * len(ids)] * len(prompts),
            "env_mask": [[1, 0, 1, 1]] * len(prompts),
            "score": list(range(len(prompts))),
            "tag": "t",
        }

    def reward(completions, score, tag, **kw):
        seen.update(completions=completions, tag=tag)
        return [float(s) for s in score]

    trainer = make_trainer(tmp_path, call_then_answer, tools=(), reward=reward, rollout_func=rollout_func)
    trainer.train()
    assert len(seen["prompts"]) == 8 and seen["prompts"][0] == [
        {"role": "user", "content": seen["prompts"][0][0]["content"]}
    ]
    assert seen["completions"][0] == [{"role": "assistant", "content": "abc"}] and seen["tag"] == ["t"] * 8
    row = trainer.state.log_history[-1]
    assert row["completions/mean_length"] == 3.0  # env_mask 0 is not a model token
    assert row["reward"] == 3.5


@pytest.mark.parametrize(
    "output, message",
    [
        ({"prompt_ids": [[1]] * 8, "completion_ids": [[1]] * 8}, r"must return keys \['logprobs'\]"),
        ({"prompt_ids": [[1]] * 8, "completion_ids": [[1]] * 7, "logprobs": [[0.0]] * 8}, "one entry per prompt"),
        (
            {"prompt_ids": [[1]] * 8, "completion_ids": [[1, 2]] * 8, "logprobs": [[0.0]] * 8},
            "one per completion token",
        ),
    ],
)
def test_rollout_func_output_errors(tmp_path, output, message):
    trainer = make_trainer(tmp_path, call_then_answer, tools=(), rollout_func=lambda prompts, trainer: output)
    with pytest.raises(ValueError, match=message):
        trainer.train()


def test_resume_from_a_checkpoint_taken_mid_cycle_is_exact(tmp_path):
    """steps_per_generation=2: the checkpoint after step 1 holds the second half of a generation batch of multi-turn
    rollouts (with their masks); resuming from it ends with the same weights as the run straight through."""
    kw = dict(steps_per_generation=2, max_steps=4, save_strategy="steps", save_steps=1, learning_rate=5e-2)
    straight = make_trainer(tmp_path / "a", call_then_answer, args=kw)
    straight.train()
    resumed = make_trainer(tmp_path / "b", call_then_answer, args=kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-1"))
    assert resumed.state.global_step == 4
    moved = 0
    first = make_model(tool_tokenizer(), context=4096).state_dict()
    for name, value in straight.unwrapped_model.state_dict().items():
        assert torch.equal(value, resumed.unwrapped_model.state_dict()[name]), name
        moved += not torch.equal(value, first[name])
    assert moved > 0
    assert straight.state.log_history[0]["tools/call_frequency"] == 0.5


def test_lora_with_tools_trains_the_adapters_only(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = make_trainer(tmp_path, call_then_answer, peft_config=lora, args=dict(learning_rate=5e-2))
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
    trainer.train()
    after = dict(trainer.unwrapped_model.named_parameters())
    moved = {n for n, p in after.items() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)
    assert all(not torch.equal(after[n], before[n]) for n in after if "lora_" in n)
    assert trainer.state.log_history[-1]["tools/call_frequency"] == 0.5


def test_an_environment_whose_reset_raises_or_whose_tool_clashes_is_named(tmp_path):
    class Broken(Counter):
        def reset(self, **row):
            raise KeyError("level")

    trainer = make_trainer(tmp_path, call_then_answer, tools=(), environment_factory=Broken)
    with pytest.raises(
        RuntimeError, match="Broken's reset\\(\\*\\*row\\) raised KeyError.*row keys: \\['k', 'prompt'\\]"
    ):
        trainer.train()

    class Clash(Counter):
        def multiply(self, a: int, b: int) -> int:
            """Also multiplies.

            Args:
                a: x
                b: y
            """
            return a * b

    with pytest.raises(ValueError, match="Two tools are named 'multiply'"):
        make_trainer(tmp_path, call_then_answer, environment_factory=Clash)


def test_rollouts_of_one_row_with_different_resets_are_not_prefix_shared(tmp_path):
    """An environment's reset may give each of a prompt's G rollouts its own prompt: the training pass must not
    share one prompt's tokens among them."""
    from grpo.rounds.groups import Scored

    class Numbered(Counter):
        handed = 0

        def reset(self, k, **row):
            Numbered.handed += 1
            return f" #{Numbered.handed}"

    trainer = make_trainer(tmp_path, lambda t, turn, j: "done", tools=(), environment_factory=Numbered)
    generated = generate(trainer, GROUPS)
    scored = Scored(GROUPS, generated.prompts, generated.rollout, torch.zeros(8, 1))
    from grpo.data.prompts import prompt_groups

    groups = prompt_groups(scored.rows, scored.rollout.prompt_ids, by_tokens=True)
    assert len(set(map(tuple, generated.rollout.prompt_ids))) == 8 and len(set(groups.tolist())) == 8
    batch = trainer._collate(scored, type("A", (), {"advantages": torch.linspace(-1, 1, 8)})())
    shared = trainer.training_pass.train(trainer.model, batch, entropy_grad=False).logps
    apart = trainer.training_pass.train(
        trainer.model, dataclasses.replace(batch, group=torch.arange(8)), entropy_grad=False
    ).logps
    torch.testing.assert_close(shared, apart)
