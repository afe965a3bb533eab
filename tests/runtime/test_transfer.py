"""runtime.transfer: host values to the device (the copy itself; that a GPU's is queued, not waited
for, is PyTorch's pinned-memory behaviour)."""

from __future__ import annotations

import torch

from llamactl.runtime.transfer import lists_to_device, to_device


def test_lists_go_over_in_one_buffer_and_keep_their_values():
    a, b, empty, c = lists_to_device([[1, 2, 3], [7], [], [-4, 5]], torch.device("cpu"), torch.int32)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [7] and empty.numel() == 0 and c.tolist() == [-4, 5]
    assert a.dtype == c.dtype == torch.int32


def test_a_host_tensor_is_copied_not_aliased_where_its_dtype_changes():
    host = torch.tensor([[1, 2], [3, 4]])
    out = to_device(host, torch.device("cpu"), torch.int32)
    host[0, 0] = 9
    assert out.tolist() == [[1, 2], [3, 4]] and out.dtype == torch.int32
    assert to_device([5, 6], torch.device("cpu"), torch.long).tolist() == [5, 6]
