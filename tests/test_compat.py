"""Every touch of JAX internals goes through jaxq/_compat.py.

JAX changes its private modules and the params of its control-flow primitives between releases
(0.11 replaced scan's ``num_consts`` / ``num_carry`` with the flat trees ``ft_in`` / ``ft_out``).
When such a touch hides in a pass, a JAX upgrade breaks it far from _compat.py, where the version
switches live; this test keeps them all in one module.
"""

import pathlib
import re

import jaxq

PACKAGE = pathlib.Path(jaxq.__file__).parent
COMPAT = PACKAGE / "_compat.py"

PRIVATE = re.compile(
    r"\bjax\._src\b"  # JAX's private modules
    # params of scan / while / cond / custom_jvp / custom_vjp (and their 0.11+ replacements)
    r"|\b(num_consts|num_carry|cond_nconsts|body_nconsts|ft_in|ft_out|jvp_jaxpr_fun"
    r"|jvp_jaxpr_thunk|fwd_jaxpr_thunk|num_consts_out|call_jaxpr|cond_jaxpr|body_jaxpr)\b"
    r"|[\"'](jaxpr|branches|linear)[\"']"  # a nested jaxpr (or scan's flags) by param name
    r"|params(\.get\(|\[)[\"']name[\"']"  # a jit call's function name
)

# Known uses outside _compat.py, each (file, token): why it is still there. Remove an entry with
# the use; an entry whose use is gone fails the test, so this list cannot go stale.
ALLOWED: dict[tuple[str, str], str] = {}


def offences(text: str) -> list[tuple[int, str]]:
    """``(line number, matched text)`` of every private touch in ``text``."""
    return [
        (i, m.group(0))
        for i, line in enumerate(text.splitlines(), 1)
        for m in PRIVATE.finditer(line)
    ]


def test_the_pattern_flags_private_touches_and_spares_public_code():
    bad = """from jax._src import core
n = eqn.params["num_carry"]
consts, carry, xs = p["ft_in"].unpack()
body = params["jaxpr"]
name = eqn.params.get("name")
for b in params['branches']: pass
flags = eqn.params.get("linear")"""
    assert [i for i, _ in offences(bad)] == [1, 2, 3, 4, 5, 6, 7]
    good = """from jax.extend import core
n = C.nested_links(eqn, key, inner)
# values inside loops or branches; a jaxpr's equations
name = C.call_name(eqn)
label = "branches[1]"
# the pass stays linear in the equations"""
    assert offences(good) == []


def test_only_compat_touches_jax_internals():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for line, token in offences(path.read_text()):
            found.setdefault((rel, token.strip("\"'")), []).append(line)
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED lists uses that are gone; remove these entries: {stale}"
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, (
        "JAX internals touched outside jaxq/_compat.py (file, token): lines\n"
        + "\n".join(f"  {f}: {t!r} at lines {ls}" for (f, t), ls in sorted(new.items()))
        + "\nwrap the access in a small function in jaxq/_compat.py (where version differences "
        "are handled) and call that instead"
    )
