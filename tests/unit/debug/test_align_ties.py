"""``asyncrl align`` leaves out tokens whose top-k support is a tie (``asyncrl.debug.align._topk_ties``): which of
two tied tokens an fp32 engine keeps in its top-k is rounding, and the sampled token's logprob then differs by the
renormalisation over k or k + 1 tokens without any weight mismatch."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from asyncrl.debug.align import TIE_TOL, _topk_ties


class _Logits(torch.nn.Module):
    """A "model" whose logits at every position are ``table[position]`` (whatever the ids)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return SimpleNamespace(logits=self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1))


def _batch(length: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros((2, length), dtype=torch.long),
            "attention_mask": torch.ones((2, length), dtype=torch.long)}


def test_a_tie_at_the_kth_logit_marks_the_next_token_and_nothing_else():
    table = torch.tensor([
        [5.0, 4.0, 3.0, 3.0, 1.0],                   # k=3: 3rd and 4th tied -> token 1 is marked
        [5.0, 4.0, 3.0, 3.0 - 10 * TIE_TOL, 1.0],    # a gap well above the tolerance: not a tie
        [5.0, 5.0, 3.0, 2.0, 1.0],                   # tied, but inside the top-k: not a boundary tie
        [5.0, 4.0, 3.0, 3.0 - TIE_TOL / 2, 1.0],     # within the tolerance: a tie
    ])
    tied = _topk_ties(_Logits(table), _batch(4), None, temperature=1.0, top_k=3, suppress_token_ids=())
    assert tied.tolist() == [[False, True, False, False]] * 2  # position t: the logits at t - 1; the last unused


def test_temperature_scales_the_gap_and_suppressed_tokens_do_not_count():
    table = torch.tensor([[5.0, 4.0, 3.0, 3.0 - 1.5 * TIE_TOL, 9.0], [0.0] * 5])
    model = _Logits(table)
    assert _topk_ties(model, _batch(2), None, temperature=1.0, top_k=3, suppress_token_ids=())[0, 1].item() is False
    # token 4 (the largest) suppressed: the top-3 is then 5, 4, 3 against 3 - 1.5e-5; at temperature 2 the gap halves
    assert _topk_ties(model, _batch(2), None, temperature=2.0, top_k=2, suppress_token_ids=(4,))[0, 1].item() is False
    assert _topk_ties(model, _batch(2), None, temperature=2.0, top_k=3, suppress_token_ids=(4,))[0, 1].item() is True


def test_no_top_k_or_a_top_k_over_the_vocabulary_marks_nothing():
    table = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    for k in (0, 3, 7):
        assert not _topk_ties(_Logits(table), _batch(2), None, temperature=1.0, top_k=k, suppress_token_ids=()).any()
