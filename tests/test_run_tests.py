"""scripts/run_tests.py (the `make test` runner): a pytest process killed by a signal fails the run and is named
with the test it was running; a clean group passes."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runner():
    spec = importlib.util.spec_from_file_location("run_tests", os.path.join(ROOT, "scripts", "run_tests.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _project(tmp_path, body: str):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_fine():\n    assert 1 + 1 == 2\n")
    (tmp_path / "tests" / "test_b.py").write_text(body)
    return str(tmp_path)


def test_signal_death_names_the_running_test(tmp_path, capsys):
    root = _project(tmp_path, "import os\n\ndef test_ok():\n    pass\n\ndef test_dies():\n    os.abort()\n")
    rc = _runner().main(["-p", "no:faulthandler"], root=root)
    err = capsys.readouterr().err
    assert rc == 1
    assert "died of SIGABRT while running tests/test_b.py::test_dies" in err


def test_clean_groups_pass(tmp_path, capsys):
    root = _project(tmp_path, "def test_ok():\n    pass\n")
    assert _runner().main([], root=root) == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out
