"""A pass that rewrites several traced forms of one computation (shared by the pass modules).

Each :class:`Form` is a plain-torch ``pattern`` traced at the aten level (with Inductor's
decompositions, as the post-grad graph holds it), the ``replacement`` that computes the same
thing with a spore op, and a ``check`` on the match. Inductor's matcher first matches the
structure ignoring scalars, shapes and dtypes, then retraces the pattern on the matched
values and requires that graph too, so scalar constants (GELU's 0.044715), slice bounds and
cast dtypes are compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import spore


@dataclass(frozen=True)
class Form:
    """One traced form: ``pattern`` and ``replacement`` take the same arguments."""

    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    example_inputs: Callable[[], list[Any]]
    check: Callable[[Any], bool]


class FormsPass(spore.GraphPass):
    """Rewrite every match of any of :meth:`forms` (tried later node first, forms in order)."""

    name = ""
    version = "1"
    priority = 0
    summary = ""

    def forms(self) -> Sequence[Form]:
        raise NotImplementedError

    def _matcher(self) -> Any:
        matcher = self.__dict__.get("_mfusion_matcher")
        if matcher is None:
            from torch._inductor.pattern_matcher import PatternMatcherPass, register_replacement

            import spore_kernels  # noqa: F401  (defines torch.ops.spore.*, which replacements call)

            matcher = PatternMatcherPass(pass_name=self.name)
            for form in self.forms():
                register_replacement(
                    form.pattern,
                    form.replacement,
                    form.example_inputs(),
                    trace,
                    matcher,
                    extra_check=form.check,
                )
            self.__dict__["_mfusion_matcher"] = matcher
        return matcher

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        return int(self._matcher().apply(gm.graph) or 0)


def trace(fn: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """``fn`` as an aten graph in the post-grad stage's terms (views written as reshapes)."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(fn, args, **kwargs)
    view_to_reshape(gm)
    return gm


def value(match: Any, name: str) -> Any:
    """The fake value (``meta["val"]``) of the match's argument ``name``, or None."""
    node = match.kwargs.get(name)
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def output_value(match: Any) -> Any:
    """The fake value of the matched subgraph's output."""
    return match.output_nodes()[0].meta.get("val")


FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def floating(*values: Any) -> bool:
    """Every value is a tensor of one floating dtype spore's ops take."""
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    return values[0].dtype in FLOATS and all(v.dtype == values[0].dtype for v in values)
