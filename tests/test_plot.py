"""`twocircuit plot` on small synthetic run folders: figures are real PNGs, the HTML embeds them and names every run,
the fidelity map's gaps are the known accuracy differences, sweeps expand into arms, bad paths exit 2 cleanly. The
collapse figures: drawn from runs that log the guard/health/length keys, noted as skipped for runs that don't, and
the guard's actions and the optimizer-state swaps are marked at the steps they happened."""

import json

import pytest
import yaml

from twocircuit_jax.cli import main
from twocircuit_jax.metrics.plot import map_cells
from twocircuit_jax.metrics.plot_collapse import guard_actions, guard_note, mark_guards, swap_steps
from twocircuit_jax.metrics.runs import Run, expand_runs

PNG = b"\x89PNG\r\n\x1a\n"


def _run(folder, *, codec="none", anchor=False, final_acc=0.5, p=0.9, rank=8, bits=1, hidden=64, steps=30, guard=None):
    """A run folder: config.yaml as the trainer resolves it (the keys plot reads) and metrics.jsonl. With `guard`
    ({step: action code}) the run also logs the collapse keys: KL, gradient norm, lengths, health gauges, the guard's
    action every step (0 but at those steps) and a cumulative swap count that rises once, at step 15."""
    folder.mkdir(parents=True)
    cfg = {
        "name": folder.name,
        "model": {"hidden_size": hidden},
        "anchor": {"enabled": anchor},
        "fast": {
            "codec": {
                "type": codec,
                **{"prf_mask": {"p": p}, "lowrank": {"rank": rank}, "sr_quant": {"quant_bits": bits}}.get(codec, {}),
            },
            "grad_codec": {"type": "none"},
        },
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
            if guard is not None:
                late = s >= 20  # the run collapses from step 20: lengths hit the cap, the monitor alarms
                row.update(
                    {
                        "kl/ref": 0.01 * s,
                        "grad/norm": 10.0 ** (s / 10),
                        "length/limit_share": 1.0 if late else s / 25,
                        "length/truncated_frac": 0.9 if late else 0.0,
                        "mismatch/kl_k3": 1e-4 * (1 + s),
                        "health/state": 2 if late else int(s >= 12),
                        "health/reward_drop": 0.5 if late else 0.0,
                        "health/length_share": 1.0 if late else s / 25,
                        "health/truncated_frac": 0.9 if late else 0.0,
                        "health/gap_ratio": 30.0 if late else 1.0,
                        "guard/action": guard.get(s, 0),
                        "guard/rollbacks": sum(1 for t, a in guard.items() if t <= s and a == 3),
                        "swap/count": int(s >= 15),
                    }
                )
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


def _vlines(ax) -> set[tuple[float, str]]:
    """(step, line style) of the vertical lines on a panel (axvline: the same x twice, spanning the axes)."""
    out = set()
    for ln in ax.lines:
        x, y = list(ln.get_xdata()), list(ln.get_ydata())
        if len(x) == 2 and x[0] == x[1] and y == [0, 1]:
            out.add((float(x[0]), ln.get_linestyle()))
    return out


@pytest.fixture
def saved_figures(monkeypatch):
    """Figures by file name as plot_runs saves them, so their panels can be checked, not only their PNG bytes."""
    from matplotlib.figure import Figure

    figs, orig = {}, Figure.savefig

    def savefig(self, path, *a, **kw):
        figs[str(path).rsplit("/", 1)[-1]] = self
        return orig(self, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figs


COLLAPSE_FIGS = ("collapse_anatomy", "truncation", "health")


def test_collapse_figures_written_listed_and_marked(tmp_path, saved_figures):
    _run(tmp_path / "collapsed", guard={12: 1, 20: 3})
    _run(tmp_path / "calm", guard={})  # logs every key, the guard never acts
    out = tmp_path / "plots"
    assert main(["plot", str(tmp_path / "collapsed"), str(tmp_path / "calm"), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    for fig in ("accuracy_reward", "mismatch", "entropy", *COLLAPSE_FIGS):
        data = (out / f"{fig}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 1000, fig
        assert f'alt="{fig}.png"' in page, fig
    assert "skipped: no run logged" not in page  # only the fidelity map (no codec run) is skipped
    marks = {(12.0, ":"), (20.0, "-.")}  # warn dotted, rollback dash-dot; the calm run adds none
    acc = saved_figures["accuracy_reward.png"]
    assert [_vlines(ax) for ax in acc.axes] == [marks, marks]
    assert "rollback (dash-dot)" in acc.axes[1].get_title() and "swaps" in acc.axes[1].get_title()
    swaps = [list(ln.get_xdata()) for ln in acc.axes[1].lines if ln.get_marker() == "v"]
    assert swaps == [[15], [15]]  # both runs' swap/count rises at step 15, and only there
    anatomy = saved_figures["collapse_anatomy.png"]
    assert len(anatomy.axes) == 4 and all(_vlines(ax) == marks for ax in anatomy.axes)
    assert anatomy.axes[2].get_yscale() == "log"
    assert any(list(ln.get_ydata()) == [1.0, 1.0] for ln in anatomy.axes[3].lines)  # the generation cap
    assert _vlines(saved_figures["entropy.png"].axes[0]) == marks
    mismatch = saved_figures["mismatch.png"]
    assert len(mismatch.axes) == 3 and mismatch.axes[2].get_yscale() == "log"
    assert mismatch.axes[2].lines and "KL" in mismatch.axes[2].get_title()
    state, gauges = saved_figures["health.png"].axes
    assert [t.get_text() for t in state.get_yticklabels()] == ["ok", "warn", "alarm"]
    assert gauges.get_yscale() == "symlog"  # the gap ratio reaches 30
    assert {t.get_text() for t in gauges.get_legend().get_texts()} == {
        "reward_drop",
        "length_share",
        "truncated_frac",
        "gap_ratio",
    }
    # the summary table's last column: rollbacks 1 (collapsed) and 0 (calm)
    rows = [r for r in page.split("<tr>") if "<td>" in r]
    assert [r.split("<td>")[-1].split("</td>")[0] for r in rows] == ["1", "0"]


def test_run_without_collapse_keys_plots_the_rest_and_notes_the_missing(runs, tmp_path, saved_figures):
    dense, _ = runs
    out = tmp_path / "plots"
    assert main(["plot", str(dense), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    for fig in ("accuracy_reward", "mismatch", "entropy", "fidelity"):
        assert (out / f"{fig}.png").read_bytes()[:8] == PNG, fig
    for fig in COLLAPSE_FIGS:
        assert not (out / f"{fig}.png").exists(), fig
    for note in ("kl/ref or grad/norm or length/limit_share", "length/truncated_frac", "health/state"):
        assert f"skipped: no run logged {note}" in page, note
    assert all(not _vlines(ax) for f in saved_figures.values() for ax in f.axes)
    assert "guard" not in saved_figures["accuracy_reward.png"].axes[1].get_title()
    assert "no run logged mismatch/kl_k3" in [t.get_text() for t in saved_figures["mismatch.png"].axes[2].texts]


def test_guard_and_swap_marks_at_their_steps():
    from matplotlib.figure import Figure

    acts = [0, 1, 0, 2, 3, 0, 7]
    counts = [0, 0, 1, 1, 2, 1, 2]  # a rollback took the count back at step 5: the rise at 6 is a new swap
    rows = [{"step": s, "guard/action": a, "swap/count": c} for s, (a, c) in enumerate(zip(acts, counts))]
    rows.append({"step": 7, "guard/action": "nan"})  # unparsable: no mark
    run = Run("r", "r", {}, rows)
    assert guard_actions(run) == [(1, 1), (3, 2), (4, 3), (6, 7)]
    assert swap_steps(run) == [2, 4, 6]
    assert swap_steps(Run("s", "s", {}, [{"step": 3, "swap/count": 1}])) == [3]  # a swap in the first step
    ax = Figure().add_subplot()
    marked = mark_guards(ax, [run], {"r": "red"})
    assert marked == [("r", 1, 1), ("r", 3, 2), ("r", 4, 3), ("r", 6, 7)]
    assert _vlines(ax) == {(1.0, ":"), (3.0, "--"), (4.0, "-."), (6.0, "-")}
    assert guard_note(marked) == "lines: guard warn (dotted), stop (dashed), rollback (dash-dot), action 7 (solid)"
    assert guard_note([]) == ""
