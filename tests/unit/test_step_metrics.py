"""asyncrl.step_metrics without a process group: a step's batch statistics and the pipeline counters."""

import math

import torch

from asyncrl.step_metrics import batch_stats, pipeline_counters


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
                   "workers": {"w0": {"busy_s": 1.5}}, "weight_sync": {"versions_published": 3}}
    assert pipeline_counters(FakeLoader(), None)["weight_sync"] == {}


def test_decoder_layers_of_a_plain_and_a_peft_model(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from asyncrl.parallel import decoder_layers
    from workers.tiny_model import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))
    layers = decoder_layers(model)
    assert layers is model.model.layers and len(layers) == model.config.num_hidden_layers
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_layers(peft) is layers
