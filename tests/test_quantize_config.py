"""Scheme / Rule / QConfig: defaults, validation messages, rule matching."""

import dataclasses
import re

import jax
import numpy as np
import pytest

import jaxq
from jaxq.quantize import QConfig, Rule, Scheme


def test_defaults():
    c = QConfig()
    assert c.weights == Scheme(granularity="channel", narrow_range=True)
    assert c.activations == Scheme(symmetric=False)
    assert (c.calibration, c.requantize, c.dynamic, c.rules) == ("minmax", "float", False, ())
    assert Scheme().qrange == (-128, 127)
    assert Scheme(narrow_range=True).qrange == (-127, 127)
    assert Scheme(bits=4, signed=False).qrange == (0, 15)


def test_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Scheme().bits = 4
    with pytest.raises(TypeError):
        Scheme(8)  # keyword-only


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 1}, "Scheme: bits must be in [2, 16]; got 1"),
        ({"bits": 17}, "Scheme: bits must be in [2, 16]; got 17"),
        ({"granularity": "row"}, "granularity must be one of"),
        (
            {"granularity": "group"},
            "Scheme: group_size must be set when granularity='group'; got None",
        ),
        ({"granularity": "group", "group_size": 0}, "group_size must be a positive int"),
        (
            {"granularity": "channel", "group_size": 8},
            "group_size only applies to granularity='group'",
        ),
        ({"rounding": "up"}, "rounding must be one of"),
        ({"signed": False, "narrow_range": True}, "leaves no code for zero"),
    ],
)
def test_scheme_rejects(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Scheme(**kwargs)


def test_scheme_types():
    with pytest.raises(TypeError, match="bits must be an int"):
        Scheme(bits=8.0)
    with pytest.raises(TypeError, match="signed must be a bool"):
        Scheme(signed=1)


def test_rule_regex_must_compile():
    with pytest.raises(
        ValueError, match=r"Rule: pattern '\(Dense' is not a valid regular expression"
    ):
        Rule(pattern="(Dense")


def test_rule_matching_and_primitives():
    r = Rule(pattern=r"Dense_\d/", primitives={"dot_general"})
    assert r.matches("MLP/Dense_0/dot_general", "dot_general")
    assert not r.matches("MLP/Dense_0/dot_general", "conv_general_dilated")
    assert not r.matches("MLP/Conv_0/conv_general_dilated", "dot_general")
    assert Rule(primitives="dot_general").primitives == frozenset({"dot_general"})
    with pytest.raises(TypeError, match="weights must be a Scheme, None or ..."):
        Rule(weights="int8")
    # (each was accepted, and the rule matched nothing or dropped a field without a word)
    with pytest.raises(ValueError, match=r"\['dot_generl'\].*did you mean dot_general\?"):
        Rule(primitives={"dot_generl"})
    with pytest.raises(ValueError, match=r"primitives \[\] must name"):
        Rule(primitives=frozenset())
    with pytest.raises(ValueError, match="skip=True leaves the layers float"):
        Rule(skip=True, weights=Scheme(bits=4))
    with pytest.raises(ValueError, match="weights=None leaves the layers unquantized"):
        Rule(weights=None, activations=Scheme(granularity="token"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weights": Scheme(granularity="token")}, "weights cannot use granularity='token'"),
        (
            {"activations": Scheme(granularity="channel")},
            "activations cannot use granularity='channel'",
        ),
        (
            {"activations": Scheme(granularity="group", group_size=4)},
            "activations cannot use granularity='group'",
        ),
        ({"activations": Scheme(granularity="token")}, "need QConfig(dynamic=True)"),
        ({"calibration": "kl"}, "calibration must be one of"),
        ({"percentile": 0}, "percentile must be in (0, 100]"),
        ({"percentile": 101}, "percentile must be in (0, 100]"),
        ({"requantize": "shift"}, "requantize must be one of"),
        ({"requantize": "fixed_point", "activations": None}, "needs static activation scales"),
        ({"requantize": "fixed_point", "dynamic": True}, "needs static activation scales"),
        (
            {"rules": (Rule(activations=Scheme(granularity="channel")),)},
            "rules[0]: activations cannot",
        ),
    ],
)
def test_qconfig_rejects(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        QConfig(**kwargs)


def test_qconfig_types():
    with pytest.raises(TypeError, match="rules must be a sequence of Rule"):
        QConfig(rules=Rule())
    with pytest.raises(TypeError, match="weights must be a Scheme"):
        QConfig(weights=None)
    assert QConfig(rules=[Rule()]).rules == (Rule(),)  # lists become tuples (hashable config)
    skip = Rule(pattern="Dense_1", skip=True)
    assert QConfig(rules=(r for r in [skip])).rules == (skip,)  # a generator, read once
    with pytest.raises(TypeError, match="rules must be a sequence of Rule"):
        QConfig(rules="Dense_1")
    hash(QConfig(rules=[Rule(primitives={"dot_general"})]))


def test_short_summary():
    assert Scheme().short() == "int8 sym tensor"
    s = Scheme(bits=4, signed=False, symmetric=False, granularity="group", group_size=32)
    assert s.short() == "uint4 asym group(32)"


def test_a_rules_scheme_takes_the_fields_it_leaves_out_from_the_configs():
    (rule,) = QConfig(rules=(Rule(weights=Scheme(bits=4), activations=Scheme(bits=6)),)).rules
    assert rule.weights == Scheme(bits=4, granularity="channel", narrow_range=True)
    assert rule.activations == Scheme(bits=6, symmetric=False)
    assert Scheme(bits=4).granularity == "tensor"  # outside a rule: Scheme's own defaults
    # granularity and group_size travel together
    grouped = Scheme(granularity="group", group_size=32)
    rules = (Rule(weights=Scheme(granularity="channel")), Rule(weights=Scheme(bits=4)))
    a, b = QConfig(weights=grouped, rules=rules).rules
    assert (a.weights.granularity, a.weights.group_size) == ("channel", None)
    assert (b.weights.granularity, b.weights.group_size) == ("group", 32)
    # a new config inherits afresh; explicit fields stay
    c = dataclasses.replace(QConfig(rules=rules), weights=Scheme(bits=6, symmetric=False))
    assert c.rules[1].weights == Scheme(bits=4, symmetric=False)
    # weights only: a rule's activation scheme has nothing to inherit from
    (w_only,) = QConfig(activations=None, rules=(Rule(activations=Scheme(bits=4)),)).rules
    assert w_only.activations == Scheme(bits=4)


def test_an_inherited_field_that_invalidates_a_rules_scheme_is_named():
    with pytest.raises(ValueError, match=re.escape("leaves no code for zero")) as err:
        QConfig(rules=(Rule(weights=Scheme(signed=False)),))
    assert str(err.value).startswith(
        "QConfig: rules[0].weights takes the fields it leaves out (bits, symmetric, granularity, "
        "group_size, narrow_range, rounding) from QConfig.weights (int8 sym channel narrow)"
    )
    (rule,) = QConfig(rules=(Rule(weights=Scheme(signed=False, narrow_range=False)),)).rules
    assert rule.weights == Scheme(signed=False, granularity="channel")


def test_a_rule_with_bits_only_quantizes_per_channel_end_to_end():
    w = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    x = np.random.default_rng(1).normal(size=(2, 8)).astype(np.float32)

    def f(x):
        with jax.named_scope("Dense_0"):
            return x @ w

    config = QConfig(rules=(Rule(pattern="Dense_0", weights=Scheme(bits=4)),))
    qf = jaxq.quantize(f, calibration=[(x,)], config=config, progress=False)
    (layer,) = qf.report().layers
    assert (layer.weights, layer.rule) == ("int4 sym channel narrow", 0)


def test_a_scheme_prints_the_fields_it_was_given():
    """So a Rule printed (the unmatched-rules warning shows them) and rebuilt means the same."""
    assert repr(Scheme(bits=4)) == "Scheme(bits=4)"
    assert repr(Scheme(bits=4, granularity="tensor")) == "Scheme(bits=4, granularity='tensor')"
    assert repr(Scheme()) == "Scheme()"
    for written in (Scheme(bits=4), Scheme(bits=4, granularity="tensor")):
        (rule,) = QConfig(rules=[Rule(pattern="x", weights=written)]).rules
        again = eval(repr(rule), {"Rule": Rule, "Scheme": Scheme})
        assert QConfig(rules=[again]).rules[0].weights.short() == rule.weights.short()
    (a,), (b,) = (
        QConfig(rules=[Rule(weights=w)]).rules
        for w in (Scheme(bits=4), Scheme(bits=4, granularity="tensor"))
    )
    assert (a.weights.short(), b.weights.short()) == (
        "int4 sym channel narrow",
        "int4 sym tensor narrow",
    )


def test_the_scheme_signature_shows_its_defaults():
    # help(Scheme) showed "<default>" for every field (the sentinel that lets a Rule inherit)
    import inspect

    params = inspect.signature(Scheme).parameters
    assert {k: p.default for k, p in params.items()} == {
        f.name: getattr(Scheme(), f.name) for f in dataclasses.fields(Scheme) if f.init
    }
