"""The quantization-error heatmap laid out for the real model: GLM-5's 78 layers + its MTP layer."""

from __future__ import annotations

import io

import numpy as np
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
    assert colorbar_label.get_text().startswith("relative RMS error\n(0 to 2x dashed: 0.1")
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
