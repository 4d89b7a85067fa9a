"""asyncrl.train.step_metrics without a process group: a step's batch statistics and the pipeline counters."""

import math

import torch

from asyncrl.train.step_metrics import batch_stats, pipeline_counters


def test_batch_stats_of_one_rank():
    got = batch_stats(torch.tensor([1.0, float("nan"), 0.5, 0.5]), torch.tensor([0.0, 1.0, 1.0, 20.0]), 123,
                      torch.device("cpu"))
    assert got["reward_mean"] == 0.5  # the NaN counts as 0 (the guard rejects that step anyway)
    assert math.isclose(got["staleness_mean"], 5.5) and got["staleness_max"] == 20.0 and got["tokens"] == 123.0
    assert got["staleness_hist"][:2] == [1, 2] and got["staleness_hist"][-1] == 1 and sum(got["staleness_hist"]) == 4


class FakeLoader:
    def stats(self):
        return {"pool": {"stale_dropped": 2, "rollouts_received": 9}, "ledger": {"regenerated": 1},
                "transport": {"bad_messages": 0, "workers": {"w0": {"busy_s": 1.5, "secret": "x"}}}}


class FakeBroadcaster:
    def stats(self):
        return {"versions_published": 3, "internal": 7}


def test_pipeline_counters_keep_the_logged_keys():
    got = pipeline_counters(FakeLoader(), FakeBroadcaster())
    assert got == {"stale_dropped": 2, "regenerated": 1, "rollouts_received": 9, "bad_messages": 0,
                   "fleet_pauses": 0, "fleet_paused_s": 0.0,  # a loader without the floor's counters
                   "workers": {"w0": {"busy_s": 1.5}}, "weight_sync": {"versions_published": 3}}
    assert pipeline_counters(FakeLoader(), None)["weight_sync"] == {}


def test_decoder_layers_of_a_plain_and_a_peft_model(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from asyncrl.testing.tiny_model import build_tiny_model
    from asyncrl.train.parallel import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))
    layers = decoder_layers(model)
    assert layers is model.model.layers and len(layers) == model.config.num_hidden_layers
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_layers(peft) is layers


def test_every_logged_loss_and_mismatch_metric_says_what_it_is_over():
    """A metric policy_loss or mismatch_metrics adds must get its weight in STEP_METRIC_WEIGHTS (else its global
    value would silently be a plain mean over ranks); without a process group global_metrics changes nothing."""
    from asyncrl.config import LossConfig
    from asyncrl.train.corrections import mismatch_metrics
    from asyncrl.train.losses import policy_loss
    from asyncrl.train.step_metrics import RANK, STEP_METRIC_WEIGHTS, SUM, global_metrics

    lp, mask = -torch.rand(2, 4), torch.ones(2, 4, dtype=torch.bool)
    logged = {}
    for loss_type in ("dapo", "cispo", "vespo"):
        _, m = policy_loss(lp, lp - 0.1, lp, torch.tensor([1.0, -1.0]), mask, ref_logprobs=lp + 0.2,
                           config=LossConfig(loss_type=loss_type, beta=0.1))
        logged |= {f"loss/{k}": v for k, v in m.items()}
    logged |= {f"mismatch/{k}": v for k, v in mismatch_metrics(lp, lp - 0.1, mask).items()}
    assert sorted(set(logged) - set(STEP_METRIC_WEIGHTS)) == []
    counts = {w for w in STEP_METRIC_WEIGHTS.values() if w not in (RANK, SUM, "max")}
    assert counts <= set(logged) and all(STEP_METRIC_WEIGHTS[c] == SUM for c in counts)
    assert global_metrics(logged, torch.device("cpu")) == logged
