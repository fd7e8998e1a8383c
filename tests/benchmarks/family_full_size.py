"""Each family's full-size layout from headers: `quantize --dry-run` on the bf16 release layout and
`gate checkpoint` on the MXFP4 layout the plan writes, both as sparse files (real safetensors headers
followed by holes: no disk, no tensor data), with the published config sizes.

    PYTHONPATH=. nice -n 15 python tests/benchmarks/family_full_size.py [--families glm4_moe,...] [--root DIR]

Each family folder says its published sizes (``manifests/families/<family>/full_size.yaml``, the
release's config.json keys; or ``full_size.py`` where the layout is not the common pattern), so a family
added as a folder brings its own. Names and shapes come from transformers' own modeling class built on
the meta device at the real sizes (a few layers; its fused 3-D expert tensors are split back into the
release's per-expert names, as save_pretrained does; Llama-4's stay fused, as its release stores them)
and repeated over every layer. Prints seconds and peak memory.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from quant.layout import family_dirs
from quant.safetensors_io import DTYPE_BYTES, numel
from quant.schema import JsonValue, Schema, load
from tests.conftest import write_sparse_shards
from tests.quant.family_checkpoints import family_module, named_as, serve_args

ST = {"torch.bfloat16": "BF16", "torch.float32": "F32"}


class FullSize(Schema):
    """A family folder's ``full_size.yaml``: the release at its published sizes (``config``, its
    config.json's keys) built by transformers' ``model_class`` on the meta device, one layer of each
    kind repeated over the layers."""
    config_class: str
    model_class: str
    expert_projections: list[str]  # the release's per-expert (gate, up, down) names: transformers' fused ones split
    mtp_layers_key: str | None = None  # the config key counting the MTP layers after the decoder
    # the layers repeat a pattern of kinds this long (a config key: Qwen3-Next full_attention_interval)
    period_key: str | None = None
    draft_prefix: str | None = None  # the draft layer stored under its own prefix, beside mtp.fc and its norms
    release_names: list[str] | None = None  # (transformers' module name, the release's) in tensor names
    next_n_tensors: bool = False  # the MTP layer's own tensors beside its decoder layer (GLM-4.5, DeepSeek-V3)
    config: dict[str, JsonValue]


def full_size(family: str) -> FullSize:
    return load(family_dirs()[family] / "full_size.yaml", FullSize, "full-size config", ValueError)


def family_layouts(family: str) -> dict[str, Callable[[], tuple[dict, list]]]:
    """The family's full-size layouts by name: its folder's ``full_size.py`` (``layout()``, or
    ``layout(variant)`` named ``<family>_<variant>`` for each of its ``VARIANTS``), else its
    ``full_size.yaml`` (``layout(family)`` here); none where the folder has neither."""
    module = family_module(family, "full_size")
    if module is not None and hasattr(module, "VARIANTS"):
        found = {f"{family}_{variant}": partial(module.layout, variant) for variant in module.VARIANTS}
    elif module is not None:
        found = {family: module.layout}
    else:
        found = {family: partial(layout, family)} if (family_dirs()[family] / "full_size.yaml").is_file() else {}
    # config.json names the family's model type (a copied folder's layout is read as the copy)
    return {name: partial(_named, family, build) for name, build in found.items()}


def _named(family: str, build: Callable[[], tuple[dict, list]]) -> tuple[dict, list]:
    config, entries = build()
    named_as(config, family)
    return config, entries


def layouts() -> dict[str, Callable[[], tuple[dict, list]]]:
    """Every discovered family's full-size layouts by name."""
    return {name: build for family in family_dirs() for name, build in family_layouts(family).items()}


def layout(family: str) -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    """(config.json, [(name, dtype, shape)]) of the family's release at full size."""
    import torch
    import transformers

    spec = full_size(family)
    config_cls, model_cls, sizes, (gate, up, down) = spec.config_class, spec.model_class, spec.config, \
        spec.expert_projections
    layers, mtp = sizes["num_hidden_layers"], sizes.get(spec.mtp_layers_key or "", 0)
    dense = sizes.get("first_k_dense_replace", 0)
    period = sizes.get(spec.period_key or "", 1)
    template_layers = dense + period + (1 if mtp else 0)  # one of each kind of layer
    config = getattr(transformers, config_cls)(**{**sizes, "num_hidden_layers": template_layers})
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    per_layer: dict[int, list] = {}
    top = []
    for name, t in model.state_dict().items():
        shape, dtype = tuple(t.shape), ST[str(torch.bfloat16 if t.dtype == torch.bfloat16 else t.dtype)]
        dtype = "BF16" if t.dtype in (torch.float16, torch.bfloat16, torch.float32) and "correction_bias" not in name \
            else dtype
        if spec.release_names:
            name = name.replace(*spec.release_names)
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        entries = [(name, dtype, shape)]
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate, up [I, H]
            e, two_i, h = shape
            entries = [(f"{name[:-len('gate_up_proj')]}{x}.{proj}.weight", dtype, (two_i // 2, h))
                       for x in range(e) for proj in (gate, up)]
        elif name.endswith("experts.down_proj"):  # [E, H, I] -> per expert down [H, I]
            entries = [(f"{name[:-len('down_proj')]}{x}.{down}.weight", dtype, shape[1:]) for x in range(shape[0])]
        if m:
            per_layer.setdefault(int(m.group(1)), []).extend(
                (re.sub(r"^model\.layers\.\d+\.", "", n), d, s) for n, d, s in entries)
        else:
            top.extend(entries)
    out = list(top)
    for i in range(layers + mtp):
        kind = (0 if i < dense else dense + (i - dense) % period) if i < layers else template_layers - 1
        out += [(f"model.layers.{i}.{rest}", d, s) for rest, d, s in per_layer[kind]]
    if spec.draft_prefix:  # the draft: a full-attention MoE layer (the pattern's last) beside fc and norms
        h, p = sizes["hidden_size"], spec.draft_prefix
        out += [(p + rest, d, s) for rest, d, s in per_layer[template_layers - 1]]
        out += [("mtp.fc.weight", "BF16", (h, 2 * h))] + [(f"mtp.{n}.weight", "BF16", (h,)) for n in
                                                          ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    if spec.next_n_tensors:  # the MTP layer's own tensors (transformers does not build them)
        h, v = sizes["hidden_size"], sizes["vocab_size"]
        p = f"model.layers.{layers}."
        out += [(p + "eh_proj.weight", "BF16", (h, 2 * h)), (p + "enorm.weight", "BF16", (h,)),
                (p + "hnorm.weight", "BF16", (h,)), (p + "shared_head.norm.weight", "BF16", (h,)),
                (p + "shared_head.head.weight", "BF16", (v, h)), (p + "embed_tokens.weight", "BF16", (v, h))]
    saved = {**config.to_dict(), **sizes, "architectures": [model_cls], "torch_dtype": "bfloat16"}
    if spec.period_key:  # the release states the interval only (the template's layer_types are 4 layers')
        saved.pop("layer_types", None)
    return saved, out


def write_sparse(dst: Path, config: dict, entries, shard_bytes: int = 5 << 30) -> int:
    """The layout in shards of about ``shard_bytes`` each (as releases shard), headers and holes."""
    chunks, size = [[]], 0
    for entry in entries:
        nbytes = DTYPE_BYTES[entry[1]] * numel(entry[2])
        if chunks[-1] and size + nbytes > shard_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += nbytes
    claimed = write_sparse_shards(dst, config, chunks)
    (dst / "tokenizer.json").write_text("{}")
    return claimed


def timed(command: list[str]) -> tuple[int, float, str]:
    start = time.time()
    # peak memory: the child's VmHWM (ru_maxrss would carry this parent's high-water mark across exec)
    done = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = sys.argv[1:]; "
                           "code = 0\ntry: runpy.run_module(sys.argv[0], run_name='__main__')\n"
                           "except SystemExit as e: code = e.code or 0\n"
                           "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
                           "print('PEAK_KB', hwm, file=sys.stderr); "
                           "sys.exit(code)", *command], capture_output=True, text=True, check=False)
    peak = re.search(r"PEAK_KB (\d+)", done.stderr)
    return done.returncode, time.time() - start, f"{int(peak.group(1)) // 1024} MB" if peak else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", help="comma-separated layout names (default: every discovered family's)")
    ap.add_argument("--root", type=Path)
    args = ap.parse_args()
    found = layouts()
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        for family in args.families.split(",") if args.families else found:
            config, entries = found[family]()
            src = Path(tmp) / family / "bf16"
            claimed = write_sparse(src, config, entries)
            # the releases the family's MXFP4 output is for, where an engine's newest release cannot load it
            serve = serve_args(family) if family in family_dirs() else []
            code, seconds, peak = timed(["quant.cli", "--to", "mxfp4", "--dry-run", "-q", "--json", *serve, str(src),
                                         str(Path(tmp) / family / "out")])
            # the MXFP4 output's layout, from the plan: headers the converter would write, holes for data
            from quant.plan import make_plan
            from quant.recipe import load_recipe
            from quant.release_check import parse_serve
            plan = make_plan(src, load_recipe(None, "mxfp4"), serve=tuple(parse_serve(s) for s in serve[1::2]))
            out = Path(tmp) / family / "mxfp4"
            write_sparse(out, plan.output_config(), [e for s in plan.shards for e in s.entries])
            gcode, gseconds, gpeak = timed(["evals.cli", "checkpoint", "--engine", "sglang==0.5.23", str(out)])
            vcode, vseconds, vpeak = timed(["evals.cli", "checkpoint", "--engine", "vllm", str(out)])
            wcode, wseconds, wpeak = timed(["evals.cli", "checkpoint", str(out)])  # the default: the whole window
            print(f"{family:<11} {len(entries):>6} tensors {claimed / 1e12:5.2f} TB bf16 | quantize --dry-run exit "
                  f"{code} {seconds:5.1f} s {peak} | gate checkpoint sglang==0.5.23 exit {gcode} {gseconds:5.1f} s "
                  f"{gpeak}, vllm exit {vcode} {vseconds:5.1f} s {vpeak}, whole window exit {wcode} {wseconds:5.1f} s "
                  f"{wpeak}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
