"""The plots page (`dvc plots show`): dvc.yaml's plot definitions (grouped by purpose, titled, axes
named, templates that exist), the page template of .dvc/config with Vega, Vega-Lite and vega-embed
inlined byte for byte as .dvc/plots/LICENSES.md lists them, and the page as DVC writes it, opened
in headless Chromium with every host unreachable: each chart is drawn, with its title."""

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
from configparser import ConfigParser

import numpy as np
import polars as pl
import pytest
import yaml
from matplotlib.colors import to_hex
from support import ROOT

from halludetect.evaluation.plot_data import (
    CLASS_COLOURS,
    CLASSES,
    METHOD_COLOURS,
    PLUGIN_COLOURS,
    class_histogram_data,
    method_colour,
    series_colour,
    with_colours,
)
from halludetect.methods import METHODS, SCORES
from halludetect.report import figures

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
PLOTS = ROOT / ".dvc" / "plots"
VERSION_NOTICE = re.compile(r'"The (input|compiled) spec uses Vega(-Lite)? v5, but (the )?current version (of|is) ')


def definitions() -> list[tuple[str, dict]]:
    return [next(iter(d.items())) for d in yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]]


def test_every_plot_has_a_title_axis_names_and_a_template_of_the_repository():
    defs = definitions()
    assert [path for path, _ in defs] == [
        "metrics/plots/layers",
        "metrics/plots/selection",
        "metrics/plots/roc",
        "metrics/plots/epochs",
        "metrics/plots/scores",
        "metrics/plots/responses",
        "metrics/plots/sensitivity",
    ]
    for path, d in defs:
        assert d.get("title") and d.get("x_label") and d.get("y_label"), path
        assert (PLOTS / f"{d['template']}.json").is_file(), path
    # layers and epochs are counts: an integer axis, never 0.5
    ints = {p for p, d in defs if d["template"] == "series_int"}
    assert ints == {"metrics/plots/layers", "metrics/plots/epochs"}
    axis = json.loads((PLOTS / "series_int.json").read_text())["encoding"]["x"]["axis"]
    assert axis == {"tickMinStep": 1, "format": "d"}
    # no stage declares plots of its own: they were one chart per method and file
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert [name for name, st in stages.items() if "plots" in st] == []


def line_layer(name: str) -> dict:
    """A series template's line (its first layer; the second draws the line's points)."""
    return json.loads((PLOTS / f"{name}.json").read_text())["layer"][0]["encoding"]


def test_the_revision_is_told_apart_by_dash_and_the_series_by_colour():
    encodings = [line_layer(name) for name in ("series", "series_int")]
    encodings.append(json.loads((PLOTS / "panels.json").read_text())["spec"]["encoding"])
    for enc in encodings:
        assert enc["color"]["field"] == "series" and enc["strokeDash"]["field"] == "rev"
        assert enc["strokeDash"]["legend"]["symbolType"] == "stroke"  # the legend draws the dash


def test_a_series_has_one_colour_in_the_pngs_and_on_the_page():
    """The templates take the colour scale's range from the data's `colour` column, which the plot
    data fill from the map the PNGs draw with: one colour per method (and class) everywhere."""
    for name in ("series", "series_int"):
        assert line_layer(name)["color"]["scale"] == {"range": {"field": "colour"}}, name
        points = json.loads((PLOTS / f"{name}.json").read_text())["layer"][1]["encoding"]["color"]
        assert points == {"field": "colour", "type": "nominal", "scale": None, "legend": None}, name
    classes = json.loads((PLOTS / "panels.json").read_text())["spec"]["encoding"]["color"]["scale"]
    assert dict(zip(classes["domain"], classes["range"])) == {name: CLASS_COLOURS[label] for name, label in CLASSES}
    # every method and score has a colour of its own
    assert set(METHOD_COLOURS) == {*METHODS, *SCORES}
    assert len(set(METHOD_COLOURS.values())) == len(METHOD_COLOURS)
    # a user's plugin has a colour too, none of ours, the same in every process (a digest of its name)
    assert method_colour("wide_max") == method_colour("wide_max") not in METHOD_COLOURS.values()
    assert not set(PLUGIN_COLOURS) & set(METHOD_COLOURS.values())
    rng = np.random.default_rng(0)
    methods = ["hami_sp", "max", "mean", "hami"]  # not the map's order: the colour goes with the name
    layer_rows = {m: [{"layer": i, "val_auroc": 0.6, "test_auroc": 0.6 + 0.01 * i} for i in range(3)] for m in methods}
    y = np.array([0, 1] * 20)
    curves = {m: (y, [rng.random(40)]) for m in [*methods, "logprob"]}
    margins = {m: {"train": [0.1, 0.2], "val": [0.1, 0.15]} for m in ("max", "mean", "hami", "hami_sp")}

    def png_colours(fig) -> dict[str, str]:
        return {line.get_label(): to_hex(line.get_color()) for ax in fig.axes for line in ax.get_lines()}

    def page_colours(frame: pl.DataFrame) -> dict[str, str]:
        pairs = frame.select("series", "colour").unique()
        assert pairs["series"].is_unique().all(), "a series with two colours"
        assert pairs["colour"].is_unique().all(), "two series of a chart with one colour: the page would mix them up"
        return dict(pairs.iter_rows())

    page = page_colours(figures.auroc_by_layer_data(layer_rows))
    png = png_colours(figures.auroc_by_layer(layer_rows, {m: 1 for m in methods}, "t"))
    assert page == {m: png[m] for m in methods} == {m: METHOD_COLOURS[m] for m in methods}
    page = page_colours(figures.roc_data(curves))
    png = png_colours(figures.roc(curves, {m: "0.5" for m in curves}, "t"))
    assert page == {m: png[f"{m} (0.5)"] for m in curves} == {m: METHOD_COLOURS[m] for m in curves}
    page = page_colours(figures.margins_by_epoch_data(margins))
    png = {
        label.split(" (layer")[0] + f" ({label.split(', ')[1].split(':')[0]})": c
        for label, c in png_colours(figures.margins_by_epoch(margins, {m: 1 for m in margins}, "t")).items()
        if "(layer" in label
    }
    assert page == png and page["hami (train)"] == METHOD_COLOURS["hami"] != page["hami (val)"]
    # the classes (the score, response and sensitivity panels): the template's, above
    fig = figures.class_panels({"p": (rng.normal(size=40), y)}, "t")
    patches = {to_hex(p.get_facecolor()[:3]) for p in fig.axes[0].patches}
    assert patches == set(CLASS_COLOURS.values())


def test_the_page_template_inlines_the_libraries_listed_in_licenses():
    config = ConfigParser()
    config.read(ROOT / ".dvc" / "config")
    assert config["plots"]["html_template"] == "plots/page.html"  # relative to .dvc/, as DVC reads it
    page = (PLOTS / "page.html").read_text(encoding="utf8")
    assert "{plot_divs}" in page and "{scripts}" not in page  # DVC's CDN script tags have nowhere to go
    assert "<script src" not in page and "http" not in page.split("<script", 1)[0]
    inlined = dict(re.findall(r'<script type="text/javascript" data-library="([^"]+)">(.*?)</script>', page, re.S))
    listed = {
        f"{lib}@{version}": digest
        for lib, version, digest in re.findall(
            r"^\| ([a-z-]+) \| ([0-9.]+) \| `[0-9a-f]{64}` \| `[^`]+` \| `([0-9a-f]{64})` \|$",
            (PLOTS / "LICENSES.md").read_text(),
            re.M,
        )
    }
    assert set(inlined) == set(listed) == {"vega@5.20.2", "vega-lite@5.2.0", "vega-embed@6.18.2"}
    for name, js in inlined.items():
        assert hashlib.sha256(js.encode("utf8")).hexdigest() == listed[name], name
    assert "/dvc_plots/" in (ROOT / ".gitignore").read_text().splitlines()


def write_plot_data(repo):
    """One grid cell's plot files, in the shapes the figures and analyze stages write."""
    rng = np.random.default_rng(0)
    methods = ["max", "hami_sp"]
    out = repo / "metrics" / "plots"
    rows = [
        {"layer": layer, "series": m, "test_auroc": rng.uniform(0.6, 0.9), "val_auroc": rng.uniform(0.6, 0.9)}
        for m in methods
        for layer in range(5)
    ]
    frames = {
        "layers": pl.DataFrame(rows),
        "roc": pl.concat(
            pl.DataFrame({"fpr": np.linspace(0, 1, 11), "series": m, "tpr": np.linspace(0, 1, 11) ** 0.5})
            for m in methods
        ),
        "selection": figures.selection_data({m: np.linspace(0.9, 0.6, 20) for m in methods}, np.linspace(0.05, 1, 20)),
        "epochs": pl.DataFrame(
            [
                {"epoch": e, "series": f"{m} ({s})", "margin": 0.1 * e}
                for m in methods
                for s in ("train", "val")
                for e in range(1, 13)
            ]
        ),
    }
    frames = {name: with_colours(frame) for name, frame in frames.items()}
    y = rng.integers(0, 2, 200)

    def panels(names):
        return pl.concat(
            class_histogram_data(rng.normal(size=200), y, bins=10).with_columns(pl.lit(n).alias("panel")) for n in names
        )

    frames["scores"] = panels([f"{m} (layer 2)" for m in methods])
    frames["responses"] = panels(["answer tokens (test)", "P_sem (test)"])
    for name, frame in frames.items():
        (out / name / "world").mkdir(parents=True)
        frame.write_csv(out / name / "world" / "world.csv")
    (out / "sensitivity" / "world" / "world").mkdir(parents=True)
    panels(["C_B^int (test)", "P_sem C_B^int (test)"]).write_csv(
        out / "sensitivity" / "world" / "world" / "hami_sp.csv"
    )


@pytest.mark.skipif(
    BROWSER is None,
    reason="no headless browser: install Debian's chromium package (apt-get install chromium); .ci/run does",
)
def test_the_plots_page_renders_every_chart_with_no_network(tmp_path):
    """`dvc plots show` (plain: the page template comes from .dvc/config) on one cell's plot data;
    Chromium opens the page with every host name unresolvable and no proxy reachable, runs its
    scripts, and the DOM then holds one SVG per chart with its title and axis names, every line in
    its series' colour (the PNGs'), and the console no error."""
    dvc = shutil.which("dvc", path=os.path.dirname(sys.executable))
    assert dvc, "dvc beside the test's python"
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=repo, check=True)
    shutil.copytree(PLOTS, repo / ".dvc" / "plots", dirs_exist_ok=True)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}))
    write_plot_data(repo)
    env = os.environ | {"DVC_NO_ANALYTICS": "1"}
    res = subprocess.run([dvc, "plots", "show"], cwd=repo, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    page = repo / "dvc_plots" / "index.html"
    text = page.read_text(encoding="utf8")
    assert "cdn.jsdelivr" not in text and "<script src" not in text
    res = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",  # tests may run as root (CI containers)
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # no host resolves: a CDN script would fail
            "--proxy-server=127.0.0.1:9",  # and nothing gets out through a proxy either
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=20000",
            "--window-size=1400,1000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    # vega-embed 6.18.2 warns that a `v5` schema is not `v5.2.0` (its semver check of a bare major:
    # DVC's own CDN page prints the same); any other console line fails, a script that did not load first
    console = [line for line in res.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not [line for line in console if not VERSION_NOTICE.search(line)], console
    charts = re.findall(r'<div id="([^"]+)"[^>]*class="vega-embed[^"]*"[^>]*>(.*?)</svg>', dom, re.S)
    texts = [html.unescape(" ".join(re.findall(r"<text[^>]*>([^<]*)</text>", body))) for _, body in charts]
    for path, d in (next(iter(p.items())) for p in plots):
        title = d["title"]
        where = [t for t in texts if title in t]
        assert len(where) == 1, (path, title, len(charts))
        assert d["x_label"] in where[0] and d["y_label"] in where[0], path
    assert len(charts) == len(plots)
    # each line is drawn in its series' colour, the one the PNGs use (a class's in the panels)
    lines = re.findall(r'<path aria-label="[^"]*series: ([^;"]+);[^"]*"[^>]*? stroke="(#[0-9a-f]{6})"', dom)
    drawn = {(html.unescape(series), colour) for series, colour in lines}
    assert {s for s, _ in drawn} == {
        "max",
        "hami_sp",
        *(f"{m} ({s})" for m in ("max", "hami_sp") for s in ("train", "val")),
        *(name for name, _ in CLASSES),
    }
    assert drawn == {(s, series_colour(s)) for s, _ in drawn}
    # and every chart names the series it draws in a legend (the points' colour layer has none, and
    # sharing one colour scale with it dropped the lines' legend: the templates resolve them apart)
    for _, body in charts:
        series = {html.unescape(s) for s in re.findall(r'<path aria-label="[^"]*series: ([^;"]+);', body)}
        text = html.unescape(" ".join(re.findall(r"<text[^>]*>([^<]*)</text>", body)))
        assert all(s in text for s in series), (series, text[:300])
