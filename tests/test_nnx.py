"""Flax NNX models get module-path names, as linen models do (skipped without flax)."""

import jax
import numpy as np
import pytest

import jaxq

nnx = pytest.importorskip("flax.nnx")


class Block(nnx.Module):
    def __init__(self, rngs):
        self.inner = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.inner(x))


class Wide(nnx.Linear):
    def __call__(self, x):  # a subclass calling its base: still one scope
        return super().__call__(x) * 2.0


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.block = Block(rngs)
        self.head = Wide(4, 2, rngs=rngs)

    def __call__(self, x):
        x = self.block(self.dense(x))
        x = self.block.inner(x)  # a grandchild called from the root
        return self.head(x)


X = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)  # (not constant: calibrated)
SCOPED = [
    "MLP/dense/dot_general",
    "MLP/block/inner/dot_general",
    "MLP/block/inner/dot_general_1",
    "MLP/head/dot_general",
]


def dots(program):
    return [e.name for e in program.equations() if e.primitive == "dot_general"]


def test_tracing_an_nnx_module_names_layers_by_module_path():
    model = MLP(nnx.Rngs(0))
    program = jaxq.trace(model, X)
    assert dots(program) == SCOPED
    np.testing.assert_allclose(program(X), model(X), rtol=1e-6)


def test_module_scopes_names_a_closure_and_restores_the_classes():
    model = MLP(nnx.Rngs(0))
    before = {cls: cls.__dict__.get("__call__") for cls in (MLP, Block, Wide, nnx.Linear)}
    with jaxq.module_scopes(model):
        assert dots(jaxq.trace(lambda x: model(x), X)) == SCOPED
    assert {cls: cls.__dict__.get("__call__") for cls in before} == before
    unscoped = ["dot_general", "dot_general_1", "dot_general_2", "dot_general_3"]
    assert dots(jaxq.trace(lambda x: model(x), X)) == unscoped


def test_module_scopes_needs_an_nnx_module():
    with (
        pytest.raises(TypeError, match="expected a flax.nnx.Module; got function"),
        jaxq.module_scopes(lambda x: x),
    ):
        pass


def test_quantizing_an_nnx_module_reports_layers_by_module_path():
    qf = jaxq.quantize(MLP(nnx.Rngs(0)), calibration=[(X,)], progress=False)
    assert [layer.name for layer in qf.report().layers] == SCOPED


def test_the_split_form_with_params_is_named_like_the_module():
    """``f(state, x) = nnx.merge(graphdef, state)(x)``, params as an argument: the module that
    ``nnx.merge`` builds while jaxq traces is scoped as the model itself would be."""
    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    merge, calls = nnx.merge, {cls: cls.__dict__.get("__call__") for cls in (MLP, Block, Wide)}

    def f(state, x):
        return nnx.merge(graphdef, state)(x)

    qf = jaxq.quantize(f, state, calibration=[(X,)], progress=False)
    assert [layer.name for layer in qf.report().layers] == SCOPED
    assert nnx.merge is merge  # (restored, and the classes too)
    assert {cls: cls.__dict__.get("__call__") for cls in calls} == calls
    np.testing.assert_allclose(np.asarray(qf(X)), np.asarray(model(X)), rtol=0.1, atol=0.05)


class Stack(nnx.Module):
    """Three blocks stacked by ``nnx.vmap`` and run by ``nnx.scan``; a head under ``nnx.remat``."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        x = body(self.dense(x), self.blocks)
        return nnx.remat(lambda m, x: m(x))(self.head, x)


def test_modules_called_inside_nnx_transforms_keep_their_paths():
    """``nnx.scan`` / ``nnx.remat`` call copies of the modules they are given: each copy takes
    the path of its original (named ``Stack/scan/dot_general_1`` before)."""
    graphdef, state = nnx.split(Stack(nnx.Rngs(0)))
    f = lambda s, x: nnx.merge(graphdef, s)(x)
    names = [
        r.name for r in jaxq.quantize(f, state, calibration=[(X,)], progress=False).report().layers
    ]
    assert names[0] == "Stack/dense/dot_general"
    assert "blocks/inner/dot_general" in names[1] and "head/dot_general" in names[2]
