"""The grading harness (minivllm/course/grading.py): every route to the package's answer is
refused, the learner's own code passes, and failures are clear (not StopIteration)."""

import asyncio
import importlib
import types

import pytest
import torch

import minivllm
from minivllm.core.block_pool import BlockPool
from minivllm.course.grading import CheckFailed, Delegated, Exercise, first_difference
from minivllm.model import layers
from minivllm.model.layers import rms_norm as imported_rms_norm


def _ex(**kw):
    return Exercise("0.1", answer=["minivllm.model.layers:rms_norm",
                                   "minivllm.core.block_pool:BlockPool"], **kw)


def own(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


bound_before = imported_rms_norm


def via_module(x, w, eps):
    return layers.rms_norm(x, w, eps)


def via_package(x, w, eps):
    return minivllm.model.layers.rms_norm(x, w, eps)


def via_bound_name(x, w, eps):
    return bound_before(x, w, eps)


def via_importlib(x, w, eps):
    return importlib.import_module("minivllm.model.layers").rms_norm(x, w, eps)


def via_default(x, w, eps, f=imported_rms_norm):
    return f(x, w, eps)


def _closure():
    f = imported_rms_norm

    def inner(x, w, eps):
        return f(x, w, eps)
    return inner


def swallowing(x, w, eps):
    try:
        return importlib.import_module("minivllm.model.layers").rms_norm(x, w, eps)
    except Exception:  # noqa: BLE001 - the cheat catches the refusal and goes on
        return own(x, w, eps)


def code_swapped(x, w, eps):
    return x


code_swapped.__code__ = imported_rms_norm.__code__
pasted = types.FunctionType(imported_rms_norm.__code__.replace(co_filename="cell.py"),
                            imported_rms_norm.__globals__)


class BarePool(BlockPool):
    pass


class Wrapper:
    def __init__(self, n):
        self.pool = getattr(importlib.import_module("minivllm.core.block_pool"), "BlockPool")(n)

    def get_num_free_blocks(self):
        return self.pool.get_num_free_blocks()


CHEATS = {
    "the package's own, imported": imported_rms_norm, "a module attribute": via_module,
    "through the package": via_package, "a name bound before grading": via_bound_name,
    "a default argument": via_default, "a closure": _closure(), "__code__ swapped": code_swapped,
    "a copy of the code": pasted, "a bare subclass": BarePool, "an alias": BlockPool,
    "a partial": __import__("functools").partial(imported_rms_norm, eps=1e-5),
}


@pytest.mark.parametrize("name", CHEATS)
def test_static_routes_are_refused(name):
    with pytest.raises(Delegated, match="Exercise 0.1: your .*minivllm"):
        _ex().take(CHEATS[name], "rms_norm")


@pytest.mark.parametrize("fn", [via_importlib, swallowing])
def test_run_time_routes_are_refused(fn):
    f = _ex(allowed="torch").take(fn)
    with pytest.raises(Delegated, match="while it ran.*You may use torch"):
        f(torch.randn(2, 4), torch.ones(4), 1e-5)


def test_run_time_route_inside_a_class():
    cls = _ex().take(Wrapper)
    with pytest.raises(Delegated, match="BlockPool"):
        cls(4).get_num_free_blocks()


def test_own_code_passes_and_runs_unchanged():
    f = _ex().take(own)
    x = torch.randn(3, 8)
    assert torch.equal(f(x, torch.ones(8), 1e-5), own(x, torch.ones(8), 1e-5))


def test_builtins_and_async_generators():
    ex = Exercise("0.2", builtin={"hash": "which differs between processes"})

    def uses_hash(t):
        return hash(tuple(t))
    with pytest.raises(Delegated, match="differs between processes"):
        ex.take(uses_hash)

    async def agen(n):
        for i in range(n):
            yield importlib.import_module("builtins").hash(i)

    async def drain():
        return [x async for x in ex.take(agen)(2)]
    with pytest.raises(Delegated, match="hash"):
        asyncio.run(drain())


def test_first_difference_and_prefix():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    ex = Exercise("0.3")
    with pytest.raises(CheckFailed, match="stops after 2 items, expected 3"):
        ex.compare_lists("tokens", [1, 2], [1, 2, 3])


def test_an_import_inside_the_function_is_refused_before_it_runs():
    def imports_inside(x, w, eps):
        from minivllm.model.layers import rms_norm
        return rms_norm(x, w, eps)
    with pytest.raises(Delegated, match="import minivllm.model.layers"):
        _ex().take(imports_inside)


def test_compare_generations_fails_clearly_on_a_strict_prefix():
    from minivllm.course.checks.common import compare_generations

    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    llm = types.SimpleNamespace(get_tokenizer=Tok)
    compare_generations("0.4", "same", llm, ["p"], [[1, 2, 3]], [[1, 2, 3]])
    with pytest.raises(CheckFailed, match=r"output token 2 \(yours has 2 tokens, expected 3\)"):
        compare_generations("0.4", "with yours", llm, ["p"], [[1, 2]], [[1, 2, 3]])
