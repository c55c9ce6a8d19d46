"""A real Jupyter kernel (nbclient + ipykernel) runs a notebook that uses the decorator
against a cluster started by the test."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import ROOT, Cluster

NOTEBOOK = ROOT / "tests" / "notebooks" / "skeleton.ipynb"


def outputs(cell: nbformat.NotebookNode) -> tuple[str, str]:
    """(stream text, execute_result text) of one executed cell."""
    stream = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    results = [o["data"]["text/plain"] for o in cell.outputs if o.output_type == "execute_result"]
    return stream, "".join(results)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")
def test_notebook_runs_decorated_functions_on_the_cluster(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BULLETIN_URL", cluster.url)
    monkeypatch.setenv("BULLETIN_TOKEN", cluster.token)
    monkeypatch.delenv("BULLETIN_CONFIG", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    cells = [outputs(c) for c in nb.cells]
    assert "hello from" in cells[1][0] and cells[1][1] == "42"
    # Re-attaching streams the call's log from its start, then returns the result.
    assert cells[2][0] == f"spawned True\nhello from {os.uname().nodename}\nre-attached 10\n"
    assert cells[3][1] == "[100, 101, 102, 103, 104]"
    assert cells[4][0] == "caught CellError raised in the cluster\n"
