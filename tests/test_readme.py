"""The README says what the code does: its test commands are CI's. (Its examples run, and print
what their comments promise, in test_docs.py, with the pages of docs/.)"""

import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.DOTALL)


def test_ci_runs_every_readme_test_command():
    commands = [b.strip() for b in blocks("bash") if "pytest" in b]
    assert len(commands) == 2  # Python 3.11 and Python 3.13
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    assert [c for c in commands if c not in ci] == []


def test_the_installed_package_carries_its_type_marker():
    # without py.typed in the wheel, a user's mypy treats all of jaxq as untyped (Any)
    import tomllib

    import jaxq

    assert (pathlib.Path(jaxq.__file__).parent / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in data["package-data"]["jaxq"]
