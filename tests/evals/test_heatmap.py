"""The quantization-error heatmap laid out for the real model: GLM-5's 78 layers + its MTP layer."""

from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from evals.judge import dashboard

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def glm5_manifest(layers: int = 78, mtp: int = 1, experts: int = 4, dense: int = 3) -> dict:
    """A conversion manifest shaped like GLM-5's: dense MLPs in the first layers, routed + shared
    experts after, the MTP layer(s) at model.layers.{layers + i}; errors synthetic."""
    rng = np.random.default_rng(0)
    quantized = {}
    for layer in range(layers + mtp):
        prefix = f"model.layers.{layer}.mlp"
        names = ([f"{prefix}.{p}.weight" for p in PROJECTIONS] if layer < dense else
                 [f"{prefix}.experts.{e}.{p}.weight" for e in range(experts) for p in PROJECTIONS]
                 + [f"{prefix}.shared_experts.{p}.weight" for p in PROJECTIONS])
        quantized.update({n: {"rel_rms_error": float(rng.uniform(0.09, 0.11))} for n in names})
    return {"shards": [{"quantized": quantized}]}


def png(fig) -> Image.Image:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    assert buf.getvalue()[:4] == b"\x89PNG"
    return Image.open(buf)


def test_glm5_sized_heatmap_is_readable_and_marks_the_mtp_layer():
    fig = dashboard.error_heatmap({"manifest": glm5_manifest(), "num_hidden_layers": 78})
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (9, 79)  # kinds x layers: dense + routed + shared, 78 + MTP
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0] == "0" and labels[-1] == "78 MTP" and sum("MTP" in t for t in labels) == 1
    assert {t.get_text() for t in ax.get_yticklabels()} >= {"experts.gate_proj", "shared_experts.down_proj", "mlp.gate_proj"}
    image = png(fig)
    small = png(dashboard.error_heatmap({"manifest": glm5_manifest(layers=8, dense=1), "num_hidden_layers": 8}))
    assert image.width > 1.8 * small.width  # the figure grows with the layers
    canvas = FigureCanvasAgg(fig)  # lay it out as saved, then measure
    canvas.draw()
    renderer = canvas.get_renderer()
    # at least 0.1 inch (10 px at 100 dpi) per layer, and every label and the colour-bar label inside the figure
    assert ax.get_window_extent().width / 79 >= 10
    box = fig.bbox
    colorbar_label = fig.axes[1].yaxis.label
    assert colorbar_label.get_text().startswith("relative RMS error, % vs\nMXFP4 on Gaussian weights (0.1")
    for text in [colorbar_label, ax.title, *ax.get_xticklabels(), *ax.get_yticklabels()]:
        extent = text.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, text


def test_small_model_title_fits_and_without_num_hidden_layers_nothing_is_marked():
    fig = dashboard.error_heatmap({"manifest": glm5_manifest(layers=4, dense=1)})
    assert not any("MTP" in t.get_text() for t in fig.axes[0].get_xticklabels())
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    title = fig.axes[0].title.get_window_extent(canvas.get_renderer())
    assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1


def test_the_heatmap_shows_how_far_each_cell_is_from_the_formats_own_error():
    """Every cell of a conversion sits near the format's error on Gaussian weights, so a scale from 0 to
    twice it painted them all one colour. The colour is now the cell's error against the format's, in
    percent: at it the middle of the scale (white), 10% above it full red, 10% below full blue."""
    expected = dashboard.format_error("mxfp4")
    errors = {"gate_proj": expected, "up_proj": 1.1 * expected, "down_proj": 0.9 * expected}
    manifest = {"shards": [{"quantized": {f"model.layers.0.mlp.{p}.weight": {"rel_rms_error": e}
                                          for p, e in errors.items()}}]}
    image = dashboard.error_heatmap({"manifest": manifest}).axes[0].images[0]
    shade = dict(zip(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), image.norm(image.get_array()[:, 0])))
    assert shade["mlp.gate_proj"] == pytest.approx(0.5) and shade["mlp.up_proj"] == pytest.approx(1.0)
    assert shade["mlp.down_proj"] == pytest.approx(0.0)
    worse = {**errors, "up_proj": 1.5 * expected}  # the scale widens to the worst cell, symmetric about the format's
    image = dashboard.error_heatmap({"manifest": {"shards": [{"quantized": {
        f"model.layers.0.mlp.{p}.weight": {"rel_rms_error": e} for p, e in worse.items()}}]}}).axes[0].images[0]
    assert image.get_clim() == pytest.approx((-50.0, 50.0))


def test_a_real_conversions_heatmap_is_not_one_colour(glm_ckpt, tmp_path):
    """The tiny GLM-5 conversion's cells (errors 0.10 to 0.12 of MXFP4's 0.11) use at least half the colour
    scale (a 0-to-2x scale gave them under a tenth of it: one colour)."""
    import json

    from quant.convert import convert
    from quant.plan import make_plan
    from quant.recipe import load_recipe

    convert(make_plan(glm_ckpt, load_recipe()), tmp_path / "mxfp4", show_progress=False)
    manifest = json.loads((tmp_path / "mxfp4" / "conversion_manifest.json").read_text())
    image = dashboard.error_heatmap({"manifest": manifest, "num_hidden_layers": 3}).axes[0].images[0]
    shades = image.norm(image.get_array().compressed())
    assert shades.max() - shades.min() >= 0.5, shades
