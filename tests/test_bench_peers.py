"""benchmarks/bench_peers.py: a tiny end-to-end run, and rows for a missing peer."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_peers  # noqa: E402


def test_missing_qwix_gives_unavailable_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "qwix", None)
    rows = bench_peers.qwix_methods("mlp", {}, [], None)
    assert [r.method for r in rows] == [f"qwix {s}" for s in bench_peers.SCHEMES]
    assert all(r.note.startswith("unavailable: ") and "qwix" in r.note for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("qwix") is None, reason="qwix not installed")
@pytest.mark.filterwarnings("ignore:'VariableState' was removed:DeprecationWarning")  # qwix on flax
def test_tiny_run_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "peers.json"
    argv = ["--models", "mlp", "--steps", "20", "--reps", "2", "2", "--rounds", "1"]
    argv += ["--calib-batches", "1", "--calib-size", "32", "--json", str(out)]
    assert bench_peers.main(argv) == 0
    result = json.loads(out.read_text())
    methods = [r["method"] for r in result["rows"]]
    assert methods[0] == "float"
    assert {f"{peer} {s}" for peer in ("jaxq", "qwix") for s in bench_peers.SCHEMES} <= set(methods)
    for r in result["rows"]:
        assert r["accuracy"] is not None, r["note"]
        assert r["accuracy"] > 0.5
        assert set(r["latency_ms"]) == {"b1", "b256"}
    assert len(result["verdicts"]) == len(bench_peers.SCHEMES) + 1  # + jaxq W4 GPTQ vs qwix W4
    assert "qwix W8A8 static" in capsys.readouterr().out
