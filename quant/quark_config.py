"""The ``quantization_config`` block of config.json in AMD Quark 0.13's schema (docs/reference.md §2)."""

from __future__ import annotations

import copy

from quant.formats.constants import BLOCK, ScaleRule

QUARK_VERSION = "0.13"
CONFIG_KINDS = ("quark", "fp8", "mxfp4")
# formats quantgate reads and decodes but does not write (quant.third_party); config_kind leaves them out, so
# every path that writes or converts sees no config it could mistake for its own
THIRD_PARTY = ("compressed-tensors", "modelopt")


def config_kind(qconfig) -> str | None:
    """The kind of a ``quantization_config``, as the engines dispatch on its ``quant_method``: ``quark``
    (Quark MX), ``fp8`` (block FP8) or ``mxfp4`` (a release's own MXFP4 layout: gpt-oss); None for no
    config, another method or a config that is not a mapping."""
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else None
    return method if method in CONFIG_KINDS else None


def format_kind(qconfig) -> str | None:
    """``compressed-tensors`` or ``modelopt`` for a third-party quantization config (config.json's
    ``quantization_config``, or hf_quant_config.json's content, whose ``producer.name`` says modelopt); None
    otherwise. ModelOpt's quant_method is ``modelopt`` (FP8) or ``modelopt_fp4`` (NVFP4) as the engines name it."""
    if not isinstance(qconfig, dict):
        return None
    method = qconfig.get("quant_method")
    if method == "compressed-tensors":
        return method
    producer = qconfig.get("producer")
    if (isinstance(method, str) and method.startswith("modelopt")) or \
            (isinstance(producer, dict) and producer.get("name") == "modelopt"):
        return "modelopt"
    # ModelOpt's own layout without a method or producer: sglang reads {"quantization": {"quant_algo": ...}} as
    # ModelOpt whoever wrote it (0.5.9 configs/model_config.py ModelConfig._parse_modelopt_quant_config), vLLM
    # by its legacy key (0.26.0 model_arch_config_convertor.py _normalize_quantization_config:
    # "modelopt_quant_config" in it)
    nested = qconfig.get("quantization")
    if method is None and isinstance(nested, dict) and "quant_algo" in nested:
        return "modelopt"
    return None


def mx_spec(dtype: str, scale_rule: ScaleRule, is_dynamic: bool) -> dict:
    return {
        "dtype": dtype, "is_dynamic": is_dynamic, "qscheme": "per_group", "ch_axis": -1,
        "group_size": BLOCK, "block_size": None, "symmetric": None, "round_method": "half_even",
        "scale_type": "float", "zero_point_type": "int32", "scale_format": "e8m0",
        "scale_calculation_mode": scale_rule.value, "mx_element_dtype": None,
        "observer_cls": "PerBlockMXObserver", "is_scale_quant": False,
        "enable_buffer_reuse": False, "max_input_numel": 4194304,
    }


def quantization_config(exclude: list[str], scale_rule: ScaleRule, weight_only: bool, dtype: str = "fp4") -> dict:
    """Quark's schema, with both dict fields vLLM iterates unguarded written as ``{}``.

    sglang's Quark loader requires ``export`` and, for MXFP4, an ``input_tensors`` spec (W4A4).
    Activations are quantized at run time, so their spec uses Quark's default ``even`` rule.
    """
    return {
        "quant_method": "quark",
        "version": QUARK_VERSION,
        "quant_mode": "eager_mode",
        "global_quant_config": {
            "input_tensors": None if weight_only else mx_spec(dtype, ScaleRule.EVEN, is_dynamic=True),
            "output_tensors": None,
            "weight": mx_spec(dtype, scale_rule, is_dynamic=False),
            "bias": None,
            "target_device": None,
        },
        "exclude": list(exclude),
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "algo_config": None,
        "softmax_quant_spec": None,
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
    }


def fp8_config(exclude: list[str]) -> dict:
    """DeepSeek-V3-style block FP8 (docs/reference.md §1), what vLLM and sglang load as block FP8."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
            "modules_to_not_convert": list(exclude)}


def strip_quantization_config(config: dict) -> dict:
    """A copy of a model config without any (nested) ``quantization_config``, as Quark does."""
    clean = copy.deepcopy(config)

    def strip(node: dict) -> None:
        node.pop("quantization_config", None)
        for value in node.values():
            if isinstance(value, dict):
                strip(value)

    strip(clean)
    return clean
