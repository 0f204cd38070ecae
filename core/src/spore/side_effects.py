"""Whether an FX node may have a side effect: what a graph pass checks before it fuses, moves
or drops the nodes around one.

torch's own check (``Node.is_impure``) reads an op's schema, and calls every other callable
pure unless torch lists it: ``x.add_(y)`` recorded as a method, ``operator.iadd``,
``torch.Tensor.add_`` called as a function, an op packet (``aten.add_``, no single schema),
``F.relu(x, inplace=True)`` or a user's function all pass as pure there. Here only ops
(``OpOverload``, higher-order ops) are judged by torch's check, and a short list of plain
callables known to mutate nothing (``operator.getitem``, Python's arithmetic and comparison
operators, ``math``'s functions, ``torch.sym_*`` arithmetic) pass; every other call may have
one. Inductor's and AOT autograd's aten graphs hold ops and ``operator.getitem`` only, so
nothing changes for them.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

_PURE = frozenset(  # plain callables known to mutate nothing (all live as long as the process)
    id(f)
    for f in (
        operator.getitem,
        *(getattr(operator, name) for name in ("add", "sub", "mul", "truediv", "floordiv")),
        *(getattr(operator, name) for name in ("mod", "pow", "neg", "pos", "abs", "invert")),
        *(getattr(operator, name) for name in ("eq", "ne", "lt", "le", "gt", "ge", "not_")),
        *(getattr(operator, name) for name in ("and_", "or_", "xor", "truth", "index")),
        *(f for name, f in vars(math).items() if callable(f) and not name.startswith("_")),
        *(getattr(torch, f"sym_{name}") for name in ("float", "int", "ite", "max", "min")),
        *(getattr(torch, f"sym_{name}") for name in ("not", "sqrt", "sum")),
    )
)
_OPS = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)  # their schemas say if they mutate
_BY_FIRST_ARG = {  # wrappers whose side effect is the wrapped op's (their first argument)
    id(torch.ops.higher_order.auto_functionalized),
    id(torch.ops.higher_order.auto_functionalized_v2),
}
# by id(op) (an OpOverload's hash is Python code) and `random`; each verdict holds its op (and
# a wrapper's wrapped op), so that no other op can take a cached id after a library is freed
_VERDICTS: dict[Any, tuple[bool, Any]] = {}


def has_side_effect(node: torch.fx.Node, *, random: bool = True) -> bool:
    """Whether ``node`` may have a side effect, so that a pass keeps it in place and fuses no
    region across it: an op whose schema mutates or that torch's check calls impure (a random
    op too, unless ``random=False``), any method or module call, and any other callable but
    the pure ones listed above. Placeholders, ``get_attr`` and the output have none."""
    if node.op != "call_function":
        return node.op in ("call_method", "call_module")
    target = node.target
    if not isinstance(target, _OPS):
        return id(target) not in _PURE
    key: Any = (id(target), random)
    held: Any = target
    if key[0] in _BY_FIRST_ARG and node.args:
        key, held = (key, id(node.args[0])), (target, node.args[0])
    cached = _VERDICTS.get(key)
    if cached is None:
        cached = _VERDICTS[key] = (node.is_impure(impure_random=random), held)
    return cached[0]
