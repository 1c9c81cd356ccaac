"""The README says what the code does: its test commands are CI's, its examples print what their
comments promise."""

import contextlib
import io
import pathlib
import re

import jaxq
from jaxq import partition as P

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.DOTALL)


def test_ci_runs_every_readme_test_command():
    commands = [b.strip() for b in blocks("bash") if "pytest" in b]
    assert len(commands) == 2  # Python 3.11 and Python 3.13
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    assert [c for c in commands if c not in ci] == []


def test_partition_example_prints_what_its_comment_promises():
    (setup,) = [b for b in blocks("python") if "program = jaxq.trace(f, w, x)" in b]
    (example,) = [b for b in blocks("python") if "P.register_op_support" in b]
    (promise,) = re.findall(r"print\(.*\)\s+# (.*)", example)
    ns = {"jaxq": jaxq}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(setup, ns)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(example, ns)
    finally:
        P.unregister_compiler("dnnl")
    assert out.getvalue().strip() == promise
