"""The docs say what the code does: their examples run, their promised outputs hold, every public
name has an entry, every config field a description, and the site builds without a warning.

Examples are the ```python blocks of README.md and docs/*.md. The blocks of one file run top to
bottom in one namespace, as a reader runs them, in a temporary directory. A ``print(...)`` whose
comment (on its line, or alone on the next) is a Python literal promises that output:

    print(len(program))              # 3
    print([r.name for r in parts])   # ['dnnl_f_0']

Other comments are prose and are not checked. Building the site needs the ``docs`` extra; that test
is skipped without it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import pathlib
import re
import subprocess
import sys
import textwrap
import tokenize
from typing import Any

import pytest

import jaxq
from jaxq import partition as P
from jaxq.transform import _pass

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
INITS = {
    "jaxq": ROOT / "jaxq" / "__init__.py",
    "jaxq.transform": ROOT / "jaxq" / "transform" / "__init__.py",
    "jaxq.annotate": ROOT / "jaxq" / "annotate" / "__init__.py",
    "jaxq.partition": ROOT / "jaxq" / "partition" / "__init__.py",
    "jaxq.quantize": ROOT / "jaxq" / "quantize" / "__init__.py",
}
# Public names with no entry of their own, and where a reader finds them instead.
NOT_AUTODOC = {
    "jaxq.annotate.on_device_p": "annotations.md names the primitives in prose",
    "jaxq.annotate.simulated_quantize_p": "annotations.md names the primitives in prose",
    "jaxq.annotate.compiler_begin_p": "annotations.md names the primitives in prose",
    "jaxq.annotate.compiler_end_p": "annotations.md names the primitives in prose",
    "jaxq.annotate.stop_fusion_p": "annotations.md names the primitives in prose",
    "jaxq.annotate.cast_hint_p": "annotations.md names the primitives in prose",
}


# -- running the examples ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    index: int  # among the page's python blocks, from 1
    line: int  # of the block's first code line in the page, from 1
    source: str

    def __str__(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}, python block {self.index} (line {self.line})"


def python_blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    out = []
    for k, m in enumerate(re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S), start=1):
        line = text.count("\n", 0, m.start(1)) + 1
        out.append(Block(page, k, line, m.group(1)))
    return out


def _literal(comment: str) -> bool:
    try:
        ast.literal_eval(comment)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def promises(source: str) -> dict[int, str]:
    """``{line of a top-level print statement: the output its comment promises}``."""
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    out = {}
    for stmt in ast.parse(source).body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print"):
            continue
        end = stmt.end_lineno or stmt.lineno
        comment = comments.get(end)
        if (comment is None or not _literal(comment)) and end + 1 not in code_lines:
            comment = comments.get(end + 1)  # a comment line of its own right below
        if comment is not None and _literal(comment):
            out[stmt.lineno] = comment
    return out


def run_page(page: pathlib.Path) -> int:
    """Run the page's python blocks in order in one namespace; return how many promised outputs
    were checked. Fails naming the block and its line on any exception or broken promise."""
    ns: dict[str, Any] = {"__name__": "__docs__"}
    checked = 0
    for block in python_blocks(page):
        try:
            tree = ast.parse(block.source, filename=str(block.page))
        except SyntaxError as e:
            pytest.fail(f"{block}: does not parse: {e}")
        promised = promises(block.source)
        for stmt in tree.body:
            first = stmt.lineno  # in the block (increment_lineno below moves it into the page)
            where = block.line + first - 1
            module = ast.Module(body=[stmt], type_ignores=[])
            ast.increment_lineno(module, block.line - 1)  # tracebacks point into the page
            code = compile(module, str(block.page), "exec")
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                    exec(code, ns)
            except Exception as e:
                pytest.fail(
                    f"{block}: line {where} raised {type(e).__name__}: {e}\n"
                    f"  {block.page.read_text().splitlines()[where - 1].strip()}"
                )
            if first in promised:
                checked += 1
                got, want = out.getvalue().strip(), promised[first]
                assert got == want, (
                    f"{block}: line {where} printed\n  {got}\nbut its comment says\n  {want}"
                )
    return checked


@pytest.fixture
def clean_registries(tmp_path, monkeypatch):
    """Examples register compilers and backends and write files: undo both afterwards."""
    monkeypatch.chdir(tmp_path)
    compilers, backends = set(P.registered_compilers()), set(P.registered_backends())
    monkeypatch.setattr(_pass, "_CONFIGS", dict(_pass._CONFIGS))  # (options they declare)
    yield
    for c in set(P.registered_compilers()) - compilers:
        P.unregister_compiler(c)
    for b in set(P.registered_backends()) - backends:
        P.unregister_backend(b)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_examples_run_and_print_what_they_promise(page, clean_registries):
    assert python_blocks(page), f"{page.relative_to(ROOT)} has no python example"
    checked = run_page(page)
    if page.name == "README.md":
        assert checked >= 1  # the partition example's region list, at least


def test_promises_are_literal_comments_on_top_level_prints():
    src = textwrap.dedent(
        """\
        print(1 + 2)   # 3
        print("x")     # prose, not a promise
        print([1,
               2])
        # [1, 2]
        for i in range(2):
            print(i)   # 0
        y = 3          # 3
        """
    )
    assert promises(src) == {1: "3", 3: "[1, 2]"}


def test_a_failing_example_names_its_page_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n\n```python\nx = 1\nprint(x)  # 2\n```\n")
    with pytest.raises(AssertionError, match=r"page.md, python block 1 \(line 4\): line 5 printed"):
        run_page(page)
    page.write_text("```bash\nexit 1\n```\n```python\nx = 1\n1 / 0\n```\n")
    with pytest.raises(
        pytest.fail.Exception, match=r"block 1 \(line 5\): line 6 raised ZeroDivision"
    ):
        run_page(page)


# -- every public name has an entry ---------------------------------------------------------------


def public_names() -> dict[str, Any]:
    """``{qualified name: object}`` for every name the public modules re-export (``from ... import
    x as x``, the convention of jaxq's ``__init__`` files), modules aside."""
    out: dict[str, Any] = {"jaxq.quantize": jaxq.quantize}
    for modname, path in INITS.items():
        module = sys.modules[modname]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.asname == alias.name:
                        obj = getattr(module, alias.name)
                        if not inspect.ismodule(obj):
                            out[f"{modname}.{alias.name}"] = obj
    return out


def resolve(dotted: str) -> Any:
    head, *rest = dotted.split(".")
    assert head == "jaxq", dotted
    obj: Any = jaxq
    for part in rest:
        obj = getattr(obj, part)
    return obj


def autodoc_targets() -> dict[str, str]:
    """``{documented name: page}`` for every autodoc directive in the docs."""
    out = {}
    for page in DOCS.glob("*.md"):
        for m in re.finditer(r"^\.\. auto\w+:: ([\w.]+)", page.read_text(), re.M):
            out[m.group(1)] = page.name
    return out


def test_every_public_name_has_an_entry_in_the_docs():
    documented = {id(resolve(name)) for name in autodoc_targets()}
    missing = [
        name
        for name, obj in public_names().items()
        if id(obj) not in documented and name not in NOT_AUTODOC
    ]
    assert missing == [], (
        f"public names without an entry in docs/*.md: {missing}. Add an autodoc directive "
        "(`.. autofunction:: jaxq.partition.new_thing`) to the page where it belongs."
    )


def test_every_documented_name_exists():
    for name, page in autodoc_targets().items():
        try:
            resolve(name)
        except AttributeError:
            pytest.fail(f"docs/{page} documents {name}, which does not exist")


# -- every dataclass field has a description --------------------------------------------------------


def docstring_fields(cls: type) -> set[str]:
    """Names described in the class docstring's ``Args:`` / ``Attributes:`` sections (napoleon's
    Google style; ``a, b: ...`` describes both), and fields with an attribute docstring."""
    names: set[str] = set()
    doc = inspect.getdoc(cls) or ""
    indent = None
    in_section = False
    for line in doc.splitlines():
        if re.fullmatch(r"(Args|Arguments|Attributes|Parameters):", line):
            in_section, indent = True, None
            continue
        if not in_section or not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if width == 0:
            in_section = False
            continue
        indent = width if indent is None else indent
        m = re.match(r"\s*([\w*, ]+?)(\s*\(.*?\))?:(\s|$)", line)
        if width == indent and m:
            names |= {n.strip() for n in m.group(1).split(",")}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return names
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    for stmt, nxt in zip(body, body[1:], strict=False):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_doc:
            names.add(stmt.target.id)
    return names


def public_dataclasses() -> dict[str, type]:
    out = {}
    for obj in public_names().values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            out.setdefault(obj.__qualname__, obj)
    return out


def test_config_classes_are_checked():
    assert {"QConfig", "Scheme", "Rule"} <= public_dataclasses().keys()


@pytest.mark.parametrize("cls", public_dataclasses().values(), ids=public_dataclasses().keys())
def test_every_field_of_a_public_dataclass_is_described(cls):
    fields = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    described = docstring_fields(cls)
    missing = [f for f in fields if f not in described]
    assert missing == [], (
        f"{cls.__name__}: fields {missing} have no description. Add them to the Args: (or "
        f"Attributes:) section of the {cls.__name__} docstring, e.g.\n    Args:\n      "
        f"{missing[0]}: what it means, its values and default."
    )
    stale = sorted(described - {f.name for f in dataclasses.fields(cls)})
    assert stale == [], f"{cls.__name__}: its docstring describes {stale}, which are not fields"


def test_field_descriptions_are_found_in_both_styles():
    @dataclasses.dataclass
    class Example:
        """Doc.

        Args:
          a, b: two at once.
          c (int): with a type.
            continuation: not a field.
        Trailing prose.
        """

        a: int
        b: int
        c: int
        d: int
        """an attribute docstring"""
        e: int

    assert docstring_fields(Example) == {"a", "b", "c", "d"}


# -- the site builds ---------------------------------------------------------------------------------


def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    # a fresh interpreter: Sphinx imports jaxq itself, and runs under its own warning filters
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(DOCS), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
    html = (tmp_path / "partition.html").read_text()
    assert "shift_right_logical" in html  # the generated table of what each backend runs
    assert "experimental" in (tmp_path / "annotations.html").read_text()
