"""K-EXAONE's tiny checkpoint for the tests (tests/quant/family_checkpoints.py write_family_checkpoint reads
this module): transformers 5.25's ExaoneMoeForCausalLM, whose save_pretrained writes the release's names
(conversion_mapping.py "exaone_moe" reverted: per-expert experts, mlp.e_score_correction_bias beside mlp.gate),
its extra decoder layer (a dense one, as both engines build the draft's) moved under the draft's prefix
mtp.layers.0 beside mtp.fc and its norms (sglang exaone_moe.py ExaoneMoEForCausalLM.load_weights with is_mtp,
vLLM exaone_moe_mtp.py ExaoneMoeMultiTokenPredictor)."""

DRAFT_LAYERS = 1  # one layer more is built: the draft's
ARCHITECTURE = "ExaoneMoEForCausalLM"  # the release's (vLLM 0.16.0 registers only this spelling)


def build(num_hidden_layers: int, **overrides):
    from transformers import ExaoneMoeConfig, ExaoneMoeForCausalLM

    from tests.quant.family_checkpoints import TINY

    # the first layer dense (first_k_dense_replace 1, as the release), the draft's layer (the last built) dense
    # too; sliding-window layers with every fourth full attention, as the release's sliding_window_pattern
    mlp = ["dense"] + ["sparse"] * (num_hidden_layers - 2) + ["dense"]
    config = ExaoneMoeConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "num_experts": 4,
                                "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
                                "mlp_layer_types": mlp, "sliding_window": 128, **overrides})
    return config, ExaoneMoeForCausalLM


def release(tensors: dict, config, num_hidden_layers: int, seed: int) -> dict:
    from tests.quant.family_checkpoints import draft_fc_shapes, random_tensors, renamed

    tensors = renamed(tensors, f"model.layers.{num_hidden_layers}.", "mtp.layers.0.")
    return {**tensors, **random_tensors(draft_fc_shapes(config.hidden_size), seed)}


def release_config(saved: dict, config, num_hidden_layers: int) -> None:
    """The draft's layer counted apart, and is_moe_layer beside mlp_layer_types: sglang's decoder layer and
    vLLM's up to 0.30.0 read config.is_moe_layer, which transformers' config does not define."""
    mlp = saved["mlp_layer_types"][:num_hidden_layers]
    saved.update(num_hidden_layers=num_hidden_layers, layer_types=saved["layer_types"][:num_hidden_layers],
                 mlp_layer_types=mlp, is_moe_layer=[kind == "sparse" for kind in mlp])
