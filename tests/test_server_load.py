"""benchmarks/load_test.py against a running server (--url): a short, bounded run of valid,
malformed and hung-up requests (streamed, non-streamed, mid-body) on a tiny model ends with no
failure and no row left in the batch; it only ever targets this machine, and passes --threads
to a server it starts.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'specdraft[serve]')")

from test_server import served, serving, tiny  # noqa: E402
from specdraft.serve import create_app  # noqa: E402

__all__ = ["tiny"]  # the module-scoped fixture, shared
LOAD_TEST = Path(__file__).resolve().parents[1] / "benchmarks" / "load_test.py"


@pytest.fixture(scope="module")
def load_test():
    spec = importlib.util.spec_from_file_location("load_test", LOAD_TEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module
    spec.loader.exec_module(module)
    return module


def test_a_short_run_against_a_running_server(tiny, load_test, tmp_path) -> None:
    model = served(tiny, max_batch_size=4, max_context=256)
    with serving(create_app(lambda: model, api_key="k")) as (u, _):
        out = tmp_path / "load.json"
        code = load_test.main(["--url", u.replace("127.0.0.1", "localhost"), "--requests", "60", "--concurrency", "1",
                               "3", "--max-tokens", "4", "--api-key", "k", "--request-timeout", "60", "--seed", "1",
                               "--out", str(out)])
        report = json.loads(out.read_text())
    levels = report["results"][0]["segments"][0]["levels"]
    assert code == 0, [lv["failures"] for lv in levels]
    assert [lv["concurrency"] for lv in levels] == [1, 3] and sum(lv["requests"] for lv in levels) == 60
    kinds = {k: sum(lv["by_kind"][k] for lv in levels) for k in ("valid", "bad", "hangup")}
    assert all(kinds.values()), kinds
    assert all(lv["after"] == {"batch_size": 0.0, "queue_depth": 0.0} for lv in levels)


def test_it_only_targets_this_machine(load_test) -> None:
    assert load_test.local_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert load_test.local_url("http://localhost:9") == "http://localhost:9"
    for url in ("http://example.com:8000", "http://10.0.0.1:8000", "https://127.0.0.1:8000", "http://127.0.0.1"):
        with pytest.raises(SystemExit, match="--url"):
            load_test.local_url(url)


def test_it_passes_threads_to_the_server(load_test) -> None:
    args = SimpleNamespace(model="gemma3-270m", dtype="auto", max_batch_size=4, max_queue=4, max_context=512,
                           shutdown_timeout=10.0, threads=1, api_key="k")
    cmd = load_test.server_command(args, "auto", 8123)
    assert cmd[cmd.index("--threads") + 1] == "1" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--api-key") + 1] == "k" and cmd[cmd.index("--shutdown-timeout") + 1] == "10.0"
