"""``plan_devices``: carry out ``on_device`` annotations (TVM's PlanDevices, simplified).

The placement rules: :func:`plan_devices`.
"""

from __future__ import annotations

import heapq
import types
from typing import Any

import jax

from jaxq import _compat as C
from jaxq import _names
from jaxq._program import Program
from jaxq._warnings import warn
from jaxq.annotate import on_device_p
from jaxq.annotate._on_device import canonical_device
from jaxq.transform import Pass, program_pass

META_KEY = "partition.placement"
"""``program.meta[META_KEY]``: ``{segment function name: device string}``."""


def device_of(spec: str) -> jax.Device:
    platform, _, index = canonical_device(spec).partition(":")
    return jax.devices(platform)[int(index)]


def plan_devices(default: Any = None) -> Pass:
    """A pass that places every top-level equation on a device per its ``on_device`` annotations
    and makes the copies between devices explicit.

    Every top-level equation gets a device:

    1. an equation whose result is annotated ``on_device(x, d)`` runs on ``d`` (the first
       annotation in program order wins);
    2. otherwise, going backwards, an equation runs where its first consumer (in program order)
       runs: the work producing a value placed on ``d`` is placed on ``d`` too;
    3. otherwise, going forwards, it runs where its first operand was computed, else on
       ``default`` (the first device when None).

    A program with no ``on_device`` is placed on ``default`` whole; with neither, it is returned
    as it is. ``on_device`` inside a nested call or loop body places nothing (a warning says so):
    annotate the call's result.

    The equations are then scheduled so that work on one device stays together (a list schedule
    that keeps to the current device while it can), and every run of equations on one device
    becomes a nested ``jit`` call (a *segment*, named ``<function>_<platform>_<index>_<k>``).
    Values crossing devices get an explicit ``device_put`` equation; ``on_device`` annotations are
    consumed. :func:`jaxq.build` then runs each segment as its own compiled call on its device, so
    the copies are real transfers and results annotated ``on_device(x, d)`` are committed to
    ``d``.
    """

    def _run(program: Program) -> Program:
        closed = program.jaxpr
        jaxpr = closed.jaxpr
        eqns = jaxpr.eqns
        nested = [
            e.name for e in program.equations() if e.primitive == "on_device" and len(e.path) > 1
        ]
        if nested:
            warn(
                f"plan_devices: {len(nested)} on_device annotation(s) inside nested calls or "
                f"loops ({nested[:3]}) place nothing: devices are placed per top-level "
                "equation. Annotate the call's result (on_device(f(x), d)) instead",
                UserWarning,
            )
        if default is None and not any(e.primitive is on_device_p for e in eqns):
            return program  # (nothing asks for a device: all stays where JAX puts it)
        home = canonical_device(
            default if default is not None else jax.devices()[0], "plan_devices"
        )
        n = len(eqns)
        producer: dict[Any, int] = {}
        for i, e in enumerate(eqns):
            for v in e.outvars:
                producer[v] = i
        want: dict[Any, str] = {}
        for e in eqns:
            if e.primitive is on_device_p and not C.is_literal(e.invars[0]):
                want.setdefault(e.invars[0], e.params["device"])
        dev: list[str | None] = [None] * n
        need: dict[Any, str] = {}
        for i in range(n - 1, -1, -1):
            e = eqns[i]
            d: str | None
            if e.primitive is on_device_p:
                d = e.params["device"]
            else:
                d = next((want[v] for v in e.outvars if v in want), None)
                if d is None:
                    d = next((need[v] for v in e.outvars if v in need), None)
            dev[i] = d
            if d is not None:
                for a in e.invars:
                    if not C.is_literal(a):
                        need[a] = d  # earlier consumers overwrite: the first one wins
        for i, e in enumerate(eqns):
            if dev[i] is None:
                src = next(
                    (producer[v] for v in e.invars if not C.is_literal(v) and v in producer), None
                )
                dev[i] = dev[src] if src is not None else home
        # on_device: an identity; where the value is already produced on the device it is dropped,
        # otherwise it becomes an explicit copy.
        subst: dict[Any, Any] = {}
        keep = [True] * n
        for i, e in enumerate(eqns):
            if e.primitive is not on_device_p:
                continue
            x = e.invars[0]
            src = None if C.is_literal(x) else producer.get(x)
            if src is not None and dev[src] == dev[i]:
                keep[i] = False
                subst[e.outvars[0]] = x
        order = _schedule(eqns, producer, dev, keep)
        return _segments(program, order, dev, subst, home)

    @program_pass(name="plan_devices")
    def run(program: Program) -> Program:
        return _run(program)

    return run


def _schedule(
    eqns: list[C.JaxprEqn], producer: dict[Any, int], dev: list[Any], keep: list[bool]
) -> list[int]:
    """A topological order that stays on one device while it can (ties: program order)."""
    n = len(eqns)
    indeg = [0] * n
    children: dict[int, list[int]] = {}
    for i, e in enumerate(eqns):
        srcs = {producer[v] for v in e.invars if not C.is_literal(v) and v in producer}
        indeg[i] = len(srcs)
        for s in srcs:
            children.setdefault(s, []).append(i)
    ready: dict[str, list[int]] = {}
    for i in range(n):
        if indeg[i] == 0:
            heapq.heappush(ready.setdefault(dev[i], []), i)
    order: list[int] = []
    current: str | None = None
    while any(ready.values()):
        if current is None or not ready.get(current):
            current = min((h[0], d) for d, h in ready.items() if h)[1]
        i = heapq.heappop(ready[current])
        if keep[i]:
            order.append(i)
        for c in children.get(i, ()):
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(ready.setdefault(dev[c], []), c)
    return order


def _segments(
    program: Program, order: list[int], dev: list[Any], subst: dict[Any, Any], home: str
) -> Program:
    closed = program.jaxpr
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    runs: list[tuple[str, list[int]]] = []
    for i in order:
        if runs and runs[-1][0] == dev[i]:
            runs[-1][1].append(i)
        else:
            runs.append((dev[i], [i]))

    def sub(v: Any) -> Any:
        while not C.is_literal(v) and v in subst:
            v = subst[v]
        return v

    seg_of: dict[Any, int] = {}
    for k, (_, idx) in enumerate(runs):
        for i in idx:
            for v in eqns[i].outvars:
                seg_of[v] = k
    exported: set[Any] = set()
    for k, (_, idx) in enumerate(runs):
        for i in idx:
            for a in eqns[i].invars:
                a = sub(a)
                if not C.is_literal(a) and seg_of.get(a, k) != k:
                    exported.add(a)
    for a in jaxpr.outvars:
        a = sub(a)
        if not C.is_literal(a) and a in seg_of:
            exported.add(a)

    outer_of: dict[Any, Any] = {}  # value computed in a segment -> the call's result outside
    where: dict[Any, str] = {}  # outside value -> its device (inputs and constants: home)
    copies: dict[tuple[Any, str], Any] = {}
    out: list[C.JaxprEqn] = []
    placement: dict[str, str] = {}
    for k, (d, idx) in enumerate(runs):
        name = f"{program.name}_{d.replace(':', '_')}_{k}"
        placement[name] = d
        target = device_of(d)
        defined: set[Any] = set()
        inner_in: list[Any] = []
        outer_in: list[Any] = []
        param: dict[Any, Any] = {}
        body: list[C.JaxprEqn] = []
        for i in idx:
            e = eqns[i]
            new_in = []
            for a in e.invars:
                a = sub(a)
                if C.is_literal(a) or a in defined:
                    new_in.append(a)
                    continue
                p = param.get(a)
                if p is None:
                    p = param[a] = C.new_var(a.aval)
                    inner_in.append(p)
                    src = outer_of.get(a, a)
                    if where.get(src, home) != d:  # an explicit copy to this segment's device
                        key = (src, d)
                        if key not in copies:
                            copies[key] = C.new_var(a.aval)
                            out.append(C.make_device_put_eqn(src, copies[key], target, e))
                            where[copies[key]] = d
                        src = copies[key]
                    outer_in.append(src)
                new_in.append(p)
            if any(a is not b for a, b in zip(new_in, e.invars, strict=True)):
                e = e.replace(invars=new_in)
            body.append(e)
            defined.update(e.outvars)
        results = [v for e in body for v in e.outvars if v in exported]
        outer_out = [C.new_var(v.aval) for v in results]
        for v, o in zip(results, outer_out, strict=True):
            outer_of[v] = o
            where[o] = d
        inner = C.make_jaxpr([], inner_in, results, body, name)
        out.append(C.make_call_eqn(C.ClosedJaxpr(inner, []), outer_in, outer_out, name, body[0]))
    outvars = []
    for a in jaxpr.outvars:
        a = sub(a)
        outvars.append(a if C.is_literal(a) else outer_of.get(a, a))
    new = C.ClosedJaxpr(jaxpr.replace(eqns=out, outvars=outvars), closed.consts)
    groups = tuple(dict.fromkeys((*program.meta.get(_names.GROUPS, ()), *placement)))
    meta = {**program.meta, META_KEY: types.MappingProxyType(placement), _names.GROUPS: groups}
    return program.with_jaxpr(new, meta=types.MappingProxyType(meta))
