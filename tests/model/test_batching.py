import math

import torch

from specdraft.core.records import Example
from specdraft.model.batching import collate


def test_collate_pads_right_and_labels_only_the_completion():
    greedy = Example("a", [5, 6, 7, 8], prompt_len=2)  # labels: the completion itself
    labelled = Example("b", [9, 3, 4], prompt_len=1, targets=[11, 12])  # labels: the target's tokens
    batch = collate([greedy, labelled], pad_id=0, device="cpu")
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 3, 4, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [-100, 11, 12, -100]]
    assert "top_ids" not in batch  # not asked for


def test_collate_lays_out_the_stored_top_k_with_minus_infinity_where_a_row_keeps_fewer():
    two = Example("a", [1, 2, 3], prompt_len=1, top_ids=[[4, 5], [6, 7]], top_logprobs=[[-0.1, -2.0], [-0.5, -1.0]])
    one = Example("b", [1, 2], prompt_len=1, top_ids=[[8]], top_logprobs=[[-0.2]])
    none = Example("c", [1, 2, 3], prompt_len=2)
    batch = collate([two, one, none], pad_id=0, device="cpu", top_logprobs=True)
    assert batch["top_ids"].shape == (3, 3, 2) and batch["top_logprobs"].dtype == torch.float32
    assert batch["top_ids"][0, 1:].tolist() == [[4, 5], [6, 7]]
    assert batch["top_logprobs"][1, 1].tolist() == [torch.tensor(-0.2).item(), -math.inf]
    assert batch["top_mask"].tolist() == [[False, True, True], [False, True, False], [False, False, False]]
