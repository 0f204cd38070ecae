"""The ``dvm`` torch.compile backend: AOT autograd with dvm's decompositions; the forward and
backward graphs both go through :func:`dvm.compile.compile_graph`."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from dvm.cluster import MIN_OPS
from dvm.compile import CompiledGraph, compile_graph
from dvm.lower import decomposition_table
from dvm.specialize import COMPILES, Specializing, symbolic_inputs


def make_backend(
    on_compile: Callable[[str, CompiledGraph], None] | None = None,
    *,
    min_ops: int = MIN_OPS,
    size_limit: int = COMPILES,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
    """A ``dvm`` backend; ``on_compile(kind, compiled)`` sees every graph it compiles, with
    ``kind`` ``"forward"``, ``"backward"`` or ``"inference"`` (a graph with symbolic sizes is
    compiled, and seen, once at most for each set of sizes it runs with: :mod:`dvm.specialize`;
    past ``size_limit`` sets, it is seen once more, as the graph run eagerly:
    :func:`dvm.compile.eager_graph`, each call past the limit counted in its ``eager_calls``);
    ``min_ops`` as in :func:`dvm.compile.compile_graph`; ``size_limit``: the most sets of sizes
    such a graph compiles (:class:`dvm.specialize.Specializing`'s ``compiles``);
    ``decompositions`` the table AOT autograd traces with (default
    :func:`dvm.lower.decomposition_table`)."""
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str):
        def compile_static(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
            compiled = compile_graph(gm, example_inputs, min_ops=min_ops)
            if on_compile is not None:
                on_compile(kind, compiled)
            return compiled

        def compile_fn(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
            symbolic = symbolic_inputs(gm)
            if symbolic:
                seen = None if on_compile is None else functools.partial(on_compile, kind)
                return _boxed(
                    Specializing(
                        gm, compile_static, compiles=size_limit, symbolic=symbolic, on_eager=seen
                    )
                )
            return _boxed(compile_static(gm, example_inputs))

        return compile_fn

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=decomposition_table() if decompositions is None else dict(decompositions),
    )


def _boxed(compiled: CompiledGraph | Specializing) -> Callable[[list[Any]], Any]:
    """``compiled`` in AOT autograd's boxed calling convention: it takes the list of arguments
    and clears it, so a backward graph frees each saved activation after its last use."""

    def run(args: list[Any]) -> Any:
        return compiled.boxed(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class DvmOptions(BaseModel):
    """``torch.compile(model, backend="dvm", options={...})``: what dvm takes there (and
    ``dvm.explain(fn, *inputs, options={...})``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_ops: StrictInt = Field(
        MIN_OPS,
        ge=1,
        description="eager kernels a region must stand for to run on the VM; 1 runs every region",
    )
    size_limit: StrictInt = Field(
        COMPILES,
        ge=1,
        description=(
            "different sets of sizes a graph with symbolic sizes compiles at most; past them, "
            "a new set runs eagerly"
        ),
    )


def parse_options(options: Mapping[str, Any] | None) -> DvmOptions:
    """``options`` as :class:`DvmOptions`; a ``ValueError`` naming what is wrong and what dvm
    takes."""
    takes = ", ".join(
        f"{name} ({field.description})" for name, field in DvmOptions.model_fields.items()
    )
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(
            f"dvm: torch.compile options must be a dict, got {type(options).__name__} "
            f"{options!r}; dvm takes {takes}, e.g. options={{'min_ops': 1}}"
        )
    try:
        return DvmOptions.model_validate(dict(options or {}))  # names that are not str too
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'options'}: {err['msg']}" for err in e.errors()
        )
        why = f"dvm: bad torch.compile options ({problems}); dvm takes {takes}"
        raise ValueError(why) from None


@functools.cache
def _backend(options: DvmOptions) -> Callable[..., Any]:
    return make_backend(**options.model_dump())


def dvm_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """``torch.compile(model, backend="dvm")``: regions on the VM, the rest eager aten,
    training included (AOT autograd). ``options`` as :class:`DvmOptions`; dvm has no modes,
    so a ``mode`` other than ``"default"`` (an Inductor mode) is ignored with a warning."""
    if mode not in (None, "default"):
        warnings.warn(
            f"dvm has no compile modes: mode={mode!r} is Inductor's and is ignored",
            UserWarning,
            stacklevel=2,
        )
    return _backend(parse_options(options))(gm, example_inputs)
