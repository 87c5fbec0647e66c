"""`twocircuit plot` on small synthetic run folders: figures are real PNGs, the HTML embeds them and names every run,
the fidelity map's gaps are the known accuracy differences, sweeps expand into arms, bad paths exit 2 cleanly."""

import json

import pytest
import yaml

from twocircuit_jax.cli import main
from twocircuit_jax.metrics.plot import expand_runs, map_cells

PNG = b"\x89PNG\r\n\x1a\n"


def _run(folder, *, codec="none", anchor=False, final_acc=0.5, p=0.9, rank=8, bits=1, hidden=64, steps=30):
    """A run folder: config.yaml as the trainer resolves it (the keys plot reads) and metrics.jsonl."""
    folder.mkdir(parents=True)
    cfg = {
        "name": folder.name,
        "model": {"hidden_size": hidden},
        "anchor": {"enabled": anchor},
        "fast": {"codec": codec, "p": p, "rank": rank, "quant_bits": bits, "grad_codec": "none"},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for s in range(steps + 1):
        row = {"step": s}
        if s % 10 == 0:
            row["eval/accuracy"] = 0.25 + (final_acc - 0.25) * s / steps
        if s > 0:
            row.update(
                {
                    "reward/mean": 0.1 + s / 100,
                    "mismatch/prob_gap_mean": 1e-3 * (1 + s % 3),
                    "mismatch/prob_corr": 0.99,
                    "policy/entropy": 1.0 - s / 100,
                }
            )
            if anchor and s % 5 == 0:
                row["anchor/fire"] = 1.0
            if s % 10 == 5:
                row["fidelity/grad_cos"] = 0.8
                row["fidelity/grad_cos_pre_merger"] = 0.6
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def runs(tmp_path):
    dense = _run(tmp_path / "dense", final_acc=0.5)
    sweep = tmp_path / "sw"
    _run(sweep / "mask", codec="prf_mask", p=0.9, final_acc=0.375)
    _run(sweep / "mask_anchor", codec="prf_mask", p=0.9, anchor=True, final_acc=0.4375)
    _run(sweep / "lr", codec="lowrank", rank=8, final_acc=0.5625)
    (sweep / "summary.json").write_text(json.dumps([{"arm": "mask_anchor"}, {"arm": "mask"}]))
    return dense, sweep


def test_plot_writes_figures_html_and_map(runs, tmp_path, capsys):
    dense, sweep = runs
    out = tmp_path / "plots"
    assert main(["plot", str(dense), str(sweep), "--out", str(out)]) == 0
    names = ["dense", "sw/mask_anchor", "sw/mask", "sw/lr"]  # summary.json order first, then by name
    assert json.loads(capsys.readouterr().out)["runs"] == names
    for fig in ("accuracy_reward", "mismatch", "entropy", "fidelity", "map"):
        data = (out / f"{fig}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 1000, fig
    page = (out / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 5
    assert all(n in page for n in names)
    cells = json.loads((out / "map.json").read_text())
    got = {(c["codec"], c["strength"], c["anchor"]): c for c in cells}
    assert set(got) == {("prf_mask", 0.9, False), ("prf_mask", 0.9, True), ("lowrank", 8, False)}
    assert [c["codec"] for c in cells] == ["prf_mask", "prf_mask", "lowrank"]
    known = {("prf_mask", 0.9, False): 0.375, ("prf_mask", 0.9, True): 0.4375, ("lowrank", 8, False): 0.5625}
    for key, acc in known.items():
        c = got[key]
        assert c["hidden"] == 64 and c["accuracy"] == pytest.approx(acc) and c["dense_accuracy"] == pytest.approx(0.5)
        assert c["gap"] == pytest.approx(acc - 0.5)
        assert c["grad_cos"] == pytest.approx(0.8) and c["prob_gap_last10"] > 0
    assert "lowrank r=8" in (out / "map.md").read_text()


def test_sweep_expands_and_hidden_sizes_split(runs, tmp_path):
    dense, sweep = runs
    assert [r.name for r in expand_runs([str(sweep)])] == ["sw/mask_anchor", "sw/mask", "sw/lr"]
    _run(tmp_path / "big" / "lr", codec="lowrank", rank=8, hidden=128, final_acc=0.6)  # no dense run at H128
    cells = map_cells(expand_runs([str(dense), str(sweep), str(tmp_path / "big")]))
    h128 = [c for c in cells if c["hidden"] == 128]
    assert len(h128) == 1 and h128[0]["dense_accuracy"] is None and h128[0]["gap"] is None


def test_plot_without_dense_skips_map_with_a_note(runs, tmp_path):
    _, sweep = runs
    out = tmp_path / "plots"
    assert main(["plot", str(sweep / "mask"), "--out", str(out)]) == 0
    assert not (out / "map.png").exists() and not (out / "map.json").exists()
    assert "skipped" in (out / "index.html").read_text()


@pytest.mark.parametrize("bad", ["missing", "empty"])
def test_bad_path_exits_2_and_writes_nothing(runs, tmp_path, capsys, bad):
    dense, _ = runs
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    out = tmp_path / "plots"
    assert main(["plot", str(dense), str(tmp_path / bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / bad) in err
    assert not out.exists()
