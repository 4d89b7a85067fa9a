"""The shadow's refusals, including a zmq receiver's (which opens its socket): what it cannot swap or fill is refused
with the fix."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import WeightSyncConfig
from asyncrl.weights import setup_weight_receiver
from asyncrl.weights.shadow import ShadowWeights

pytestmark = pytest.mark.integration  # real processes or sockets (tests/unit opens none)


def test_shadow_refuses_what_it_cannot_swap():
    fused = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="different views of one storage"):
        ShadowWeights({"qkv": fused, "q": fused[:4]})
    with pytest.raises(ValueError, match="contiguous"):
        ShadowWeights({"t": torch.zeros(4, 4).t()})
    emb = torch.zeros(4)
    live = {"a": emb, "b": emb}
    shadow = ShadowWeights(live)
    shadow.acquire()
    fill, _ = shadow.finish()

    class Update:
        version, metadata = 1, {"shadow": shadow, "shadow_fill": fill}

    with pytest.raises(ValueError, match="tied"):
        shadow.swap_into({"a": torch.zeros(4), "b": torch.zeros(4)}, Update())  # untied since: refused, nothing moved
    strided = torch.zeros(8)[::2]  # same names, dtype and shape, other strides: its storage would be the next target
    with pytest.raises(ValueError, match="contiguous=False"):
        shadow.swap_into({"a": strided, "b": strided}, Update())
    assert shadow.swap_into(live, Update())
    with pytest.raises(ValueError, match="weights.type='shm'"):
        WeightSyncConfig(type="zmq", shadow=True)
    z = setup_weight_receiver("zmq", "tcp://127.0.0.1:1", receiver_id="z")
    with pytest.raises(ValueError, match="cannot fill"):
        z.attach_shadow(shadow)
    z.close()
