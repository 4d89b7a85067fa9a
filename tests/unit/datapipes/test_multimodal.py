"""Image prompts without a model: the bytes of an image group survive the codec and the pool unchanged, a corrupted
or mislabelled image is refused by the gate with a counted reason while the groups beside it pass, the batch keeps
each row's images and hashes, and the visual task and image helpers behave."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from asyncrl.codec import DecodeError, decode, encode
from asyncrl.config import GateConfig
from asyncrl.data.images import (
    MAX_IMAGES,
    ImageError,
    decode_image,
    image_bytes,
    image_provenance,
    prompt_images,
    verify_images,
)
from asyncrl.data.visual_task import draw_squares, visual_count_prompts
from asyncrl.pool.buffer import RolloutPool
from asyncrl.pool.gate import GateError, check_group
from asyncrl.pool.ledger import PromptLedger
from asyncrl.rollout import Group, Rollout
from datapipes.collate import collate_groups

GROUP_SIZE = 2


def _image_group(prompt_index: int, images: list[bytes], *, provenance: list | None = None,
                 worker_id: str = "w0") -> Group:
    meta = {"images": [image_provenance(x) for x in images] if provenance is None else provenance}
    rollouts = [Rollout(epoch=0, prompt_index=prompt_index, sample_index=s, worker_id=worker_id, policy_version=0,
                        prompt_ids=torch.tensor([1, 7, 7, 7, 2], dtype=torch.int32),
                        response_ids=torch.tensor([3, 4], dtype=torch.int32),
                        logprobs=torch.tensor([-0.5, -0.1]), reward=float(s), metadata=meta, images=list(images))
                for s in range(GROUP_SIZE)]
    return Group(epoch=0, prompt_index=prompt_index, rollouts=rollouts)


def _truncated(png: bytes) -> bytes:
    return png[: len(png) // 2]


def test_image_group_round_trips_codec_and_pool_byte_for_byte():
    images = [draw_squares(3, distractors=1, seed=5), draw_squares(1, seed=6)]
    group = _image_group(0, images)
    kind, body = decode(encode("group", group.to_wire()))
    back = Group.from_wire(body, group_size=GROUP_SIZE)
    assert kind == "group" and all(r.images == images for r in back.rollouts)
    check_group(back, GateConfig(vocab_size=512))

    ledger = PromptLedger(1, seed=0)
    pool = RolloutPool(ledger, group_size=GROUP_SIZE, capacity=4, max_staleness=0)
    pool.start_epoch(0)
    (lease,) = pool.grant("w0", 1)
    assert pool.add_rollouts(back.rollouts, lease_id=lease.lease_id) == GROUP_SIZE
    taken = pool.take(timeout=5)
    assert taken is not None and [r.images for r in taken.rollouts] == [images] * GROUP_SIZE
    hashes = [hashlib.sha256(x).hexdigest() for x in images]
    assert [p["sha256"] for p in taken.rollouts[0].metadata["images"]] == hashes
    # the pool's state dict (a checkpoint) carries them too, through the same codec
    pool2 = RolloutPool(PromptLedger(1, seed=0), group_size=GROUP_SIZE, capacity=4, max_staleness=0)
    state = decode(encode("state", pool.state_dict()))[1]
    pool2.load_state_dict(state)

    batch = collate_groups([taken])
    assert batch["images"] == [images] * GROUP_SIZE and batch["image_sha256"] == [hashes] * GROUP_SIZE


def test_text_batches_have_no_image_keys_and_text_rollouts_send_no_images():
    r = _image_group(0, [])
    assert "images" not in r.rollouts[0].to_wire()
    assert "images" not in collate_groups([r])


def test_image_placeholders_are_prompt_tokens_outside_the_loss_mask():
    group = _image_group(0, [draw_squares(2)])
    batch = collate_groups([group])
    prompt = int(group.rollouts[0].prompt_ids.numel())
    assert not batch["loss_mask"][:, :prompt].any() and batch["loss_mask"][:, prompt : prompt + 2].all()


@pytest.mark.parametrize("bad, reason", [
    (lambda png: [_truncated(png)], "does not decode"),
    (lambda png: [b"GIF89a" + b"\0" * 40], "does not decode"),
    (lambda png: [png[:-12] + bytes(12)], "does not decode"),  # the IEND chunk's CRC zeroed
    (lambda png: [png[:60] + bytes([png[60] ^ 1]) + png[61:]], "does not decode"),  # one bit of the pixel data
])
def test_corrupted_image_refused_at_gate_with_reason_others_pass(bad, reason):
    good = _image_group(0, [draw_squares(2, seed=1)])
    images = bad(draw_squares(2, seed=1))
    broken = _image_group(1, images, provenance=[{"sha256": hashlib.sha256(x).hexdigest(), "nbytes": len(x)}
                                                  for x in images])
    gate = GateConfig(vocab_size=512)
    # through the codec first: the wire is fine with any bytes, the gate is what refuses them
    broken = Group.from_wire(decode(encode("group", broken.to_wire()))[1], group_size=GROUP_SIZE)
    with pytest.raises(GateError, match=reason) as e:
        check_group(broken, gate)
    assert e.value.reason == "image_corrupt" and e.value.uid == "e0-p1-s0"
    check_group(good, gate)  # nothing else is affected


def test_image_not_matching_its_provenance_is_refused():
    png, other = draw_squares(2, seed=1), draw_squares(3, seed=1)
    swapped = _image_group(0, [other], provenance=[image_provenance(png)])
    with pytest.raises(GateError, match="do not match its provenance") as e:
        check_group(swapped, GateConfig())
    assert e.value.reason == "image_corrupt"


def test_wire_refuses_images_that_are_not_bytes_or_too_many():
    group = _image_group(0, [draw_squares(1)])
    wire = group.to_wire()
    wire["rollouts"][0]["images"] = ["not bytes"]
    with pytest.raises(DecodeError, match="images must be a list"):
        Group.from_wire(wire)
    wire["rollouts"][0]["images"] = [b"x"] * (MAX_IMAGES + 1)
    with pytest.raises(DecodeError, match="images must be a list"):
        Group.from_wire(wire)


def test_image_helpers(tmp_path):
    png = draw_squares(4, seed=2)
    path = tmp_path / "x.png"
    path.write_bytes(png)
    assert image_bytes(png) == image_bytes(str(path)) == image_bytes({"bytes": png}) == image_bytes({"path": path})
    assert prompt_images({"images": [str(path)]}) == [png] and prompt_images({"prompt_ids": [1]}) == []
    im = decode_image(png)
    assert im.size == (32, 32) and im.mode == "RGB"
    p = image_provenance(png)
    assert p == {"sha256": hashlib.sha256(png).hexdigest(), "nbytes": len(png), "format": "PNG", "width": 32,
                 "height": 32}
    with pytest.raises(ImageError, match="cannot read image"):
        image_bytes(str(tmp_path / "missing.png"))
    with pytest.raises(ImageError, match="must be bytes, a path"):
        image_bytes(3)
    with pytest.raises(ImageError, match="more than MAX_IMAGES"):
        verify_images([png] * (MAX_IMAGES + 1))


def test_visual_task_counts_red_squares_deterministically():
    from PIL import Image  # noqa: F401 - the task needs Pillow

    items = visual_count_prompts(40, seed=3)
    assert items == visual_count_prompts(40, seed=3)
    assert {it["answer"] for it in items} == {"1", "2", "3", "4"}
    for it in items[:10]:
        im = decode_image(it["images"][0])
        red = int((np.asarray(im) == (230, 20, 20)).all(-1).sum())
        assert red == int(it["answer"]) * 36  # 6x6 px per square, never overlapping
        assert it["messages"][0]["content"][0] == {"type": "image"}
