"""The trainer applies the loss normalizers so that gradient accumulation gives the update of one large batch
(dapo: token mean over the whole batch; grpo: mean of per-sequence means), on fixed completions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo import GRPOTrainer
from support.rewards import token_count_reward
from support.runs import cfg, chat_dataset
from support.scripted import FixedEngine


def updated_params(tiny_model_dir, tmp_path, **kw):
    args = cfg(tmp_path, shuffle_dataset=False, learning_rate=1e-3, gradient_checkpointing=False, **kw)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)  # an update linear in the gradient: compares gradients
    trainer = GRPOTrainer(
        model=model, reward_funcs=token_count_reward, train_dataset=chat_dataset(), args=args, optimizers=(sgd, None)
    )
    trainer.engine = FixedEngine(trainer.processing_class)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, trainer


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo"])
def test_accumulated_update_equals_one_batch_update(tiny_model_dir, tmp_path, loss_type):
    one, t1 = updated_params(tiny_model_dir, tmp_path / "a", loss_type=loss_type, per_device_train_batch_size=8)
    two, t2 = updated_params(
        tiny_model_dir,
        tmp_path / "b",
        loss_type=loss_type,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    assert t1.args.generation_batch_size == t2.args.generation_batch_size == 8
    assert not t2._needs_old_logps()  # spg == GA: still on-policy, no old-log-prob pass
    g1 = t1.state.log_history[-1]["grad_norm"]
    g2 = t2.state.log_history[-1]["grad_norm"]
    assert g1 > 0 and g2 == pytest.approx(g1, rel=1e-5)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-8)


class _TwoProcesses:
    """An accelerator of 2 processes whose peer's statistics are given: counts the collectives called."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, peer_row):
        self.peer_row, self.calls = peer_row, []

    def gather(self, tensor):
        self.calls.append("gather")
        return torch.cat([tensor, self.peer_row.reshape(tensor.shape)])

    def reduce(self, tensor, reduction="sum"):
        self.calls.append("reduce")
        return tensor + self.peer_row[: tensor.numel()].reshape(tensor.shape)


def test_loss_statistics_are_reduced_in_one_collective():
    """Every loss statistic of a micro-step in one gather (not one all-reduce or gather and one host sync each):
    the global masked mean (sums over counts), the min of mins and the max of maxes, NaN (a process without
    values) left out; hand-computed."""
    from grpo.algo.losses import Stat
    from grpo.distributed.collectives import reduce_stats

    stats = {
        "kl": Stat("mean", torch.tensor([3.0, 2.0])),
        "clip/low_min": Stat("min", torch.tensor(0.25)),
        "clip/high_max": Stat("max", torch.tensor(float("nan"))),
        "entropy": Stat("mean", torch.tensor([0.0, 0.0])),
    }
    peer = torch.tensor([5.0, 6.0, -1.0, 4.0, 0.0, 0.0])  # kl (sum, count), min, max, entropy with no tokens
    acc = _TwoProcesses(peer)
    got = reduce_stats(stats, acc)
    assert acc.calls == ["gather"]
    assert got == {"kl": 1.0, "clip/low_min": -1.0, "clip/high_max": 4.0, "entropy": 0.0}
    one = reduce_stats(stats, SimpleNamespace(num_processes=1, device=torch.device("cpu")))
    assert one["kl"] == 1.5 and one["clip/low_min"] == 0.25 and math.isnan(one["clip/high_max"])
    assert reduce_stats({}, acc) == {} and acc.calls == ["gather"]
