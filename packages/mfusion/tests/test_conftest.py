"""The shared comparison with eager (``assert_rel_close``) where eager's values hold ±inf or NaN."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("got", "want"),
    [
        ([0.0, 5.0, 123.0], [1.0, INF, -7.0]),  # finite where eager has inf: the scale was inf
        ([1.0, -INF, 2.0], [1.0, INF, 2.0]),  # the other sign
        ([1.0, 0.0, 2.0], [1.0, NAN, 2.0]),  # finite where eager has NaN
        ([1.0, NAN, 2.0], [1.0, INF, 2.0]),
        ([1.0, INF, 2.0], [1.0, NAN, 2.0]),
        ([NAN, INF, 2.0], [1.0, INF, 2.0]),  # NaN where eager is finite
        ([1.1, INF, 2.0], [1.0, INF, 2.0]),  # the finite part off by 0.1 of its largest 2.0
    ],
)
def test_inf_and_nan_must_match_and_scale_the_rest_not(
    assert_rel_close: Callable[..., None], got: list[float], want: list[float]
) -> None:
    with pytest.raises(AssertionError):
        assert_rel_close(torch.tensor(got), torch.tensor(want))


def test_matching_inf_and_nan_with_a_close_finite_part_pass(
    assert_rel_close: Callable[..., None],
) -> None:
    want = torch.tensor([1.0, INF, -INF, NAN, -2.0])
    assert_rel_close(want + torch.tensor([1e-6, 0.0, 0.0, 0.0, -1e-6]), want)
    assert_rel_close(torch.tensor([NAN, -INF]), torch.tensor([NAN, -INF]))  # nothing finite
